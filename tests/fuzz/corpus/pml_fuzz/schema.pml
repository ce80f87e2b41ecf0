<schema name="travel">
  <system>You are a travel agent.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="4"/> days.</module>
    <union>
      <module name="tokyo">Tokyo</module>
      <module name="miami">Miami<module name="beach">Sand</module></module>
    </union>
  </user>
</schema>
