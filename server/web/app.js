/* kvserve's web page: a chat over /v1/chat/completions (streamed) and a live view of the context
 * cache from /metrics, /v1/cache/stats and /v1/schemas. Plain JavaScript, no library: the page is
 * served from the binary under a Content-Security-Policy that allows this origin only, so all
 * text goes in through textContent and all charts are drawn here on <canvas>. */
'use strict';

(() => {
  const KEY_STORAGE = 'kvserve.apiKey';
  const POLL_MS = 3000; // the cache pane's refresh
  const WINDOW_MS = 180000; // the occupancy chart's time span, once it has that much
  const MIN_SPAN_MS = 20000; // its span at first
  const TIER_LABELS = {
    pool: 'KV pool', ram: 'RAM', disk: 'disk', redis: 'Redis',
    blend_ram: 'blend RAM', blend_disk: 'blend disk',
  };
  const TIER_COLORS = {
    pool: '--c-pool', ram: '--c-ram', disk: '--c-disk', redis: '--c-redis',
    blend_ram: '--c-blend', blend_disk: '--c-blend-disk',
  };
  const REUSE_CLASSES = [
    { key: 'none', label: 'no reuse', color: '--c-none' },
    { key: 'cached', label: 'cached KV', color: '--c-pool' },
    { key: 'blend', label: 'blend', color: '--c-blend' },
  ];

  const $ = (id) => document.getElementById(id);
  const state = {
    model: null,
    messages: [], // the conversation sent with each request
    controller: null, // the answer streaming now, if any
    pollTimer: null,
    polling: false,
    pollAgain: false, // a refresh asked for while one was running
    occupancy: [], // [{t, shares: {tier: share of capacity}}], oldest first
  };

  /* ------------------------------------------------------------ API access and the key */

  class AuthError extends Error {}

  function storedKey() {
    try {
      return sessionStorage.getItem(KEY_STORAGE) || '';
    } catch (e) {
      return ''; // storage disabled: the page still works without a key
    }
  }

  function storeKey(key) {
    try {
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      else sessionStorage.removeItem(KEY_STORAGE);
    } catch (e) {
      setStatus('this browser keeps no session storage: the key is lost on reload', true);
    }
  }

  // The message of an OpenAI-shaped error reply, else the start of its text.
  async function errorMessage(resp) {
    let text = '';
    try {
      text = await resp.text();
    } catch (e) {
      /* the body could not be read: the status says enough */
    }
    try {
      const j = JSON.parse(text);
      if (j && j.error && typeof j.error.message === 'string') return j.error.message;
    } catch (e) {
      /* not JSON */
    }
    return text.trim().slice(0, 300) || `HTTP ${resp.status}`;
  }

  // fetch with the key; a 401 opens the key form and throws AuthError.
  async function api(path, opts = {}) {
    const headers = Object.assign({}, opts.headers);
    const key = storedKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const resp = await fetch(path, Object.assign({}, opts, { headers, cache: 'no-store' }));
    if (resp.status === 401) {
      const msg = await errorMessage(resp);
      showAuth(msg);
      throw new AuthError(msg);
    }
    return resp;
  }

  function showAuth(message) {
    document.body.dataset.state = 'auth';
    $('auth').hidden = false;
    $('auth-message').textContent = message
      ? `${storedKey() ? 'The server refused this key' : 'This server needs an API key'} ` +
        `(401): ${message}`
      : '';
    $('key-cancel').hidden = !state.model;
    $('send').disabled = true;
    setStatus('API key needed', true);
    $('key-input').focus();
  }

  // The key form opened by hand (to change or forget the key), not by a refusal.
  function openKeyForm() {
    $('auth').hidden = false;
    $('auth-message').textContent = '';
    $('key-cancel').hidden = false;
    $('send').disabled = true;
    $('key-input').focus();
  }

  function hideAuth() {
    $('auth').hidden = true;
    $('auth-message').textContent = '';
  }

  function setStatus(text, bad = false) {
    const el = $('status');
    el.textContent = text;
    el.classList.toggle('bad', bad);
  }

  /* ------------------------------------------------------------ connecting */

  async function connect() {
    setStatus('connecting…');
    let resp;
    try {
      resp = await api('/v1/models');
    } catch (e) {
      if (!(e instanceof AuthError)) {
        document.body.dataset.state = 'error';
        setStatus(`cannot reach the server: ${e.message}`, true);
        setTimeout(connect, 3000);
      }
      return;
    }
    if (resp.status === 503) { // loading, or shutting down
      setStatus(`waiting: ${await errorMessage(resp)}`);
      setTimeout(connect, 1000);
      return;
    }
    if (!resp.ok) {
      document.body.dataset.state = 'error';
      setStatus(`/v1/models: ${resp.status}: ${await errorMessage(resp)}`, true);
      return;
    }
    const list = await resp.json().catch(() => null);
    const id = list && Array.isArray(list.data) && list.data[0] && list.data[0].id;
    if (typeof id !== 'string') {
      document.body.dataset.state = 'error';
      setStatus('/v1/models listed no model', true);
      return;
    }
    state.model = id;
    $('model').textContent = id;
    hideAuth();
    document.body.dataset.state = 'ready';
    setStatus('ready');
    $('send').disabled = !!state.controller;
    pollSoon(0);
  }

  /* ------------------------------------------------------------ chat */

  function scrollToEnd(force) {
    const box = $('messages');
    if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 80)
      box.scrollTop = box.scrollHeight;
  }

  function addMessage(role, text) {
    $('empty-chat').hidden = true;
    const el = document.createElement('article');
    el.className = `msg ${role}`;
    const r = document.createElement('div');
    r.className = 'role';
    r.textContent = role;
    const body = document.createElement('div');
    body.className = 'text';
    body.textContent = text;
    el.append(r, body);
    $('messages').append(el);
    scrollToEnd(true);
    return el;
  }

  // An assistant answer being streamed: text appended as it comes, usage shown at the end.
  function addAnswer() {
    const el = addMessage('assistant', '');
    el.dataset.state = 'streaming';
    el.dataset.deltas = '0';
    const text = document.createTextNode('');
    el.querySelector('.text').append(text);
    let deltas = 0;
    return {
      el,
      append(piece) {
        text.appendData(piece);
        el.dataset.deltas = String(++deltas);
        scrollToEnd(false);
      },
      note(msg, isError) {
        const p = document.createElement('p');
        p.className = isError ? 'note error' : 'note muted';
        p.textContent = msg;
        el.append(p);
      },
      // fields: [key, label, value] shown under the answer (value null: left out)
      finish(how, fields) {
        el.dataset.state = how;
        const dl = document.createElement('dl');
        dl.className = 'usage';
        for (const [key, label, value] of fields) {
          if (value === null || value === undefined) continue;
          const div = document.createElement('div');
          const dt = document.createElement('dt');
          dt.textContent = label;
          const dd = document.createElement('dd');
          dd.dataset.k = key;
          dd.textContent = value;
          div.append(dt, dd);
          dl.append(div);
        }
        if (dl.childElementCount) el.append(dl);
        scrollToEnd(false);
      },
    };
  }

  // A form field's number within [lo, hi], or an Error saying what is wrong with it.
  function numberField(id, label, lo, hi, integer) {
    const raw = $(id).value.trim();
    const v = Number(raw);
    if (raw === '' || !Number.isFinite(v) || v < lo || v > hi || (integer && !Number.isInteger(v)))
      throw new Error(`${label} must be ${integer ? 'a whole number' : 'a number'} from ${lo} ` +
                      `to ${hi}`);
    return v;
  }

  // Reads a server-sent event stream, calling onEvent with each JSON event; resolves at
  // `data: [DONE]`. A stream that ends without it is an error: the answer may be cut.
  async function readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = '';
    let finished = false;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
        for (let m; (m = /\r?\n\r?\n/.exec(buf));) {
          const block = buf.slice(0, m.index);
          buf = buf.slice(m.index + m[0].length);
          const data = block.split(/\r?\n/)
            .filter((l) => l.startsWith('data:'))
            .map((l) => l.slice(l[5] === ' ' ? 6 : 5))
            .join('\n');
          if (!data) continue; // a comment or keep-alive
          if (data === '[DONE]') {
            finished = true;
            return;
          }
          let ev;
          try {
            ev = JSON.parse(data);
          } catch (e) {
            throw new Error(`the server sent an event that is not JSON: ${data.slice(0, 80)}`);
          }
          onEvent(ev);
        }
        if (done) throw new Error('the stream ended before [DONE]: the answer may be cut short');
      }
    } finally {
      if (!finished) reader.cancel().catch(() => {});
    }
  }

  function fmtMs(ms) {
    if (ms === null || ms === undefined || !Number.isFinite(ms)) return null;
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  async function send(ev) {
    ev.preventDefault();
    if (state.controller || !state.model) return;
    const content = $('prompt').value.trim();
    if (!content) return;
    let maxTokens, temperature;
    try {
      maxTokens = numberField('max-tokens', 'max tokens', 1, 1 << 20, true);
      temperature = numberField('temperature', 'temperature', 0, 2, false);
    } catch (e) {
      $('form-error').textContent = e.message;
      return;
    }
    $('form-error').textContent = '';
    const userEl = addMessage('user', content);
    // this answer's conversation: New chat replaces state.messages, and a stopped answer must
    // not land in the new one
    const convo = state.messages;
    convo.push({ role: 'user', content });
    $('prompt').value = '';
    const answer = addAnswer();
    const controller = new AbortController();
    state.controller = controller;
    $('send').disabled = true;
    $('stop').disabled = false;

    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    let text = '';
    let usage = null;
    let finish = null;
    let how = 'done';
    try {
      const resp = await api('/v1/chat/completions', {
        method: 'POST',
        signal: controller.signal,
        headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({
          model: state.model,
          messages: convo,
          stream: true,
          stream_options: { include_usage: true },
          max_tokens: maxTokens,
          temperature,
        }),
      });
      if (!resp.ok) throw new Error(`${resp.status}: ${await errorMessage(resp)}`);
      await readEvents(resp, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || 'the answer ended with an error');
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          if (c.index !== 0) continue;
          const piece = c.delta && typeof c.delta.content === 'string' ? c.delta.content : '';
          if (piece) {
            tLast = performance.now();
            if (tFirst === null) tFirst = tLast;
            text += piece;
            answer.append(piece);
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
      });
    } catch (e) {
      if (e.name === 'AbortError') {
        how = 'stopped';
        answer.note('stopped', false);
      } else {
        how = 'error';
        answer.note(e instanceof AuthError ? 'not sent: the server needs an API key (above)'
          : e.message, true);
      }
    }
    state.controller = null;
    $('stop').disabled = true;
    $('send').disabled = !state.model || !$('auth').hidden;

    if (text || how === 'done') {
      convo.push({ role: 'assistant', content: text });
    } else {
      // nothing came back: the question leaves the conversation (after an error, it goes back
      // in the box to be sent again)
      convo.pop();
      userEl.classList.add('failed');
      if (how === 'error' && !$('prompt').value) $('prompt').value = content;
    }
    if (finish === 'length') answer.note('cut at max tokens', false);
    const details = (usage && usage.prompt_tokens_details) || {};
    const decodeMs = tFirst !== null && tLast > tFirst ? tLast - tFirst : null;
    const completion = usage ? usage.completion_tokens : null;
    answer.finish(how, [
      ['prompt_tokens', 'prompt', usage ? usage.prompt_tokens : null],
      ['cached_tokens', 'cached', usage ? (details.cached_tokens || 0) : null],
      ['blended_tokens', 'blended', details.blended_tokens === undefined ? null
        : details.blended_tokens],
      ['completion_tokens', 'generated', completion],
      ['ttft', 'TTFT', fmtMs(tFirst === null ? null : tFirst - t0)],
      ['speed', 'speed', decodeMs && completion > 1
        ? `${((completion - 1) / (decodeMs / 1000)).toFixed(1)} tok/s` : null],
    ]);
    pollSoon(200); // the cache pane shows what this answer did
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  function newChat() {
    stop();
    state.messages = [];
    for (const el of [...$('messages').querySelectorAll('.msg')]) el.remove();
    $('empty-chat').hidden = false;
    $('prompt').focus();
  }

  /* ------------------------------------------------------------ Prometheus text */

  // name -> [{labels, value}] from the text exposition format (version 0.0.4).
  function parseMetrics(text) {
    const out = new Map();
    for (const raw of text.split('\n')) {
      const line = raw.trim();
      if (!line || line[0] === '#') continue;
      const name = /^[a-zA-Z_:][a-zA-Z0-9_:]*/.exec(line);
      if (!name) continue;
      let i = name[0].length;
      const labels = {};
      let ok = true;
      if (line[i] === '{') {
        i++;
        for (;;) {
          while (line[i] === ' ' || line[i] === ',') i++;
          if (line[i] === '}') {
            i++;
            break;
          }
          const ln = /^[a-zA-Z_][a-zA-Z0-9_]*="/.exec(line.slice(i));
          if (!ln) {
            ok = false;
            break;
          }
          i += ln[0].length;
          let v = '';
          for (; i < line.length && line[i] !== '"'; i++) {
            if (line[i] === '\\' && i + 1 < line.length) {
              i++;
              v += line[i] === 'n' ? '\n' : line[i];
            } else {
              v += line[i];
            }
          }
          if (line[i] !== '"') {
            ok = false;
            break;
          }
          i++;
          labels[ln[0].slice(0, -2)] = v;
        }
      }
      if (!ok) continue;
      const word = line.slice(i).trim().split(/\s+/)[0];
      const value = word === '+Inf' ? Infinity : word === '-Inf' ? -Infinity : Number(word);
      if (word === '' || (Number.isNaN(value) && word !== 'NaN')) continue;
      if (!out.has(name[0])) out.set(name[0], []);
      out.get(name[0]).push({ labels, value });
    }
    return out;
  }

  // The value of the first sample of `name` whose labels include `match`, or undefined.
  function sample(m, name, match = {}) {
    for (const s of m.get(name) || [])
      if (Object.entries(match).every(([k, v]) => s.labels[k] === v)) return s.value;
    return undefined;
  }

  // A histogram's series: {count, sum, buckets: [[le, cumulative count], ...]} or null.
  function histogram(m, name, match) {
    const count = sample(m, `${name}_count`, match);
    if (count === undefined) return null;
    const buckets = (m.get(`${name}_bucket`) || [])
      .filter((s) => Object.entries(match).every(([k, v]) => s.labels[k] === v))
      .map((s) => [s.labels.le === '+Inf' ? Infinity : Number(s.labels.le), s.value])
      .sort((a, b) => a[0] - b[0]);
    return { count, sum: sample(m, `${name}_sum`, match) || 0, buckets };
  }

  // The q-quantile of a histogram, interpolated within its bucket (as Prometheus'
  // histogram_quantile); in the +Inf bucket, the highest finite bound.
  function quantile(h, q) {
    if (!h || !h.count) return null;
    const rank = q * h.count;
    let prevLe = 0;
    let prevCount = 0;
    for (const [le, c] of h.buckets) {
      if (c >= rank) {
        if (le === Infinity) return prevLe;
        if (c === prevCount) return le;
        return prevLe + ((le - prevLe) * (rank - prevCount)) / (c - prevCount);
      }
      prevLe = le;
      prevCount = c;
    }
    return prevLe;
  }

  /* ------------------------------------------------------------ drawing */

  function cssColor(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || '#888';
  }

  const ROW_H = 30;

  // The canvas at cssH CSS pixels high and its width, in device pixels for a sharp drawing;
  // returns its context (in CSS pixels) and size.
  function canvasFor(canvas, cssH) {
    canvas.style.height = `${cssH}px`;
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 400;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(cssH * dpr);
    const ctx = canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, cssH);
    ctx.font = '12px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    return { ctx, w, h: cssH };
  }

  /* Rows of horizontal bars on a canvas sized for them: each row has a label, a track from 0 to
   * 1, a bar to `frac`, an optional tick at `tick`, and a text at its right. */
  function drawRows(canvas, rows) {
    const { ctx, w } = canvasFor(canvas, Math.max(rows.length, 1) * ROW_H + 6);
    const labelW = 78;
    const textW = Math.min(190, w * 0.38);
    const x0 = labelW;
    const x1 = Math.max(x0 + 40, w - textW - 8);
    const fg = cssColor('--fg');
    const muted = cssColor('--muted');
    const track = cssColor('--track');
    if (!rows.length) {
      ctx.fillStyle = muted;
      ctx.fillText('nothing to show yet', 4, ROW_H / 2);
      return;
    }
    rows.forEach((r, i) => {
      const y = 3 + i * ROW_H;
      const mid = y + ROW_H / 2;
      ctx.fillStyle = fg;
      ctx.textAlign = 'left';
      ctx.fillText(r.label, 2, mid, labelW - 6);
      ctx.fillStyle = track;
      ctx.fillRect(x0, y + 6, x1 - x0, ROW_H - 12);
      const color = cssColor(r.color);
      if (r.frac !== null && r.frac > 0) {
        ctx.fillStyle = color;
        // anything above zero stays visible
        ctx.fillRect(x0, y + 6, Math.max(2, Math.min(1, r.frac) * (x1 - x0)), ROW_H - 12);
      }
      if (r.tick !== undefined && r.tick !== null) {
        const tx = x0 + Math.min(1, r.tick) * (x1 - x0);
        ctx.fillStyle = fg;
        ctx.fillRect(tx - 1, y + 3, 2, ROW_H - 6);
      }
      ctx.fillStyle = r.dim ? muted : fg;
      ctx.textAlign = 'left';
      ctx.fillText(r.text, x1 + 8, mid, w - x1 - 10);
    });
  }

  // A round step for about `n` axis ticks up to `top`: 1, 2 or 5 times a power of ten.
  function niceStep(top, n) {
    const raw = top / n;
    const p = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 5, 10].map((k) => k * p).find((s) => s >= raw);
  }

  /* Lines over time: series [{color, points: [[t, value], ...]}] over the time since the first
   * point (MIN_SPAN_MS to WINDOW_MS), the value axis from 0 to a round number above the largest
   * value (at least `floor`), its ticks written with fmt. */
  function drawLines(canvas, series, now, floor, fmt) {
    const { ctx, w, h } = canvasFor(canvas, 150);
    const left = 52;
    const right = w - 8;
    const top = 8;
    const bottom = h - 20;
    const muted = cssColor('--muted');
    const grid = cssColor('--line');
    const largest = Math.max(floor, ...series.flatMap((s) => s.points.map((p) => p[1])));
    const step = niceStep(largest, 4);
    const vmax = Math.ceil(largest / step - 1e-9) * step;
    const first = Math.min(now, ...series.flatMap((s) => s.points.map((p) => p[0])));
    const span = Math.min(WINDOW_MS, Math.max(MIN_SPAN_MS, now - first));
    const xOf = (t) => right - ((right - left) * (now - t)) / span;
    const yOf = (v) => bottom - ((bottom - top) * v) / vmax;
    ctx.lineWidth = 1;
    ctx.fillStyle = muted;
    ctx.textAlign = 'right';
    for (let v = 0; v <= vmax + step / 2; v += step) {
      const y = Math.round(yOf(v)) + 0.5;
      ctx.strokeStyle = grid;
      ctx.beginPath();
      ctx.moveTo(left, y);
      ctx.lineTo(right, y);
      ctx.stroke();
      ctx.fillText(fmt(v, step), left - 6, y);
    }
    ctx.textAlign = 'left';
    ctx.fillText(span < 120000 ? `−${Math.round(span / 1000)} s`
      : `−${Math.round(span / 60000)} min`, left, h - 8);
    ctx.textAlign = 'right';
    ctx.fillText('now', right, h - 8);
    ctx.lineWidth = 2;
    ctx.lineJoin = 'round';
    for (const s of series) {
      const pts = s.points.filter((p) => now - p[0] <= span);
      if (!pts.length) continue;
      ctx.strokeStyle = ctx.fillStyle = cssColor(s.color);
      if (pts.length === 1) {
        ctx.beginPath();
        ctx.arc(xOf(pts[0][0]), yOf(pts[0][1]), 2.5, 0, 2 * Math.PI);
        ctx.fill();
        continue;
      }
      ctx.beginPath();
      pts.forEach(([t, v], k) => (k ? ctx.lineTo(xOf(t), yOf(v)) : ctx.moveTo(xOf(t), yOf(v))));
      ctx.stroke();
    }
  }

  function fillTable(table, head, rows, caption) {
    table.replaceChildren();
    if (caption) {
      const c = document.createElement('caption');
      c.textContent = caption;
      table.append(c);
    }
    const hr = document.createElement('tr');
    for (const h of head) {
      const th = document.createElement('th');
      th.textContent = h;
      hr.append(th);
    }
    const thead = document.createElement('thead');
    thead.append(hr);
    const tbody = document.createElement('tbody');
    for (const r of rows) {
      const tr = document.createElement('tr');
      if (r.id) tr.dataset.row = r.id;
      r.cells.forEach(([key, value]) => {
        const td = document.createElement('td');
        if (key) td.dataset.k = key;
        td.textContent = value;
        tr.append(td);
      });
      if (r.swatch) {
        const sw = document.createElement('span');
        sw.className = `swatch ${r.swatch}`;
        tr.firstChild.prepend(sw);
      }
      tbody.append(tr);
    }
    table.append(thead, tbody);
  }

  /* ------------------------------------------------------------ number formats */

  function fmtInt(n) {
    return n === undefined || n === null ? '–' : Math.round(n).toLocaleString('en-US');
  }

  function fmtBytes(n) {
    if (n === undefined || n === null) return '–';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let u = 0;
    while (n >= 1024 && u < units.length - 1) {
      n /= 1024;
      u++;
    }
    return `${u ? n.toFixed(n < 10 ? 2 : 1) : n} ${units[u]}`;
  }

  function fmtPct(f) {
    if (f === null || f === undefined || !Number.isFinite(f)) return '–';
    const p = f * 100;
    return `${p === 0 || p >= 10 ? p.toFixed(0) : p >= 0.1 ? p.toFixed(1) : p.toPrecision(1)}%`;
  }

  /* ------------------------------------------------------------ the cache pane */

  // The tiers this server runs, in lookup order (stats: /v1/cache/stats, or null).
  function tiersOf(stats, m) {
    const names = ['pool', 'ram', 'disk', 'redis', 'blend_ram', 'blend_disk'];
    if (stats && stats.tiers)
      return names.filter((t) => stats.tiers[t] && stats.tiers[t].enabled);
    // no stats (an error): the tiers that were looked up
    return names.filter((t) => (sample(m, 'kvserve_cache_hits_total', { tier: t }) || 0) +
                               (sample(m, 'kvserve_cache_misses_total', { tier: t }) || 0) > 0);
  }

  function showOccupancy(stats, m, tiers) {
    const now = Date.now();
    const shares = {};
    const table = [];
    for (const t of tiers) {
      const ts = stats && stats.tiers ? stats.tiers[t] : null;
      let used;
      let cap;
      let unit;
      if (t === 'pool') {
        used = sample(m, 'kvserve_kv_pool_blocks_cached');
        cap = sample(m, 'kvserve_kv_pool_blocks_total');
        unit = 'blocks';
      } else if (ts) {
        used = ts.bytes;
        cap = ts.capacity_bytes;
        unit = 'bytes';
      }
      const entries = ts ? ts.entries : undefined;
      if (t === 'redis') {
        // shared by instances: what it holds is not this server's to measure
        const up = ts && ts.connected;
        table.push({ id: t, swatch: t, cells: [[null, TIER_LABELS[t]], ['entries', '–'],
                                               ['used', 'shared'], ['capacity', '–'],
                                               ['share', up ? 'connected' : 'not connected']] });
        continue;
      }
      const frac = cap ? used / cap : null;
      if (frac !== null) shares[t] = frac;
      const show = unit === 'bytes' ? fmtBytes : (n) => `${fmtInt(n)} blocks`;
      table.push({ id: t, swatch: t, cells: [[null, TIER_LABELS[t]], ['entries', fmtInt(entries)],
                                             ['used', show(used)], ['capacity', show(cap)],
                                             ['share', fmtPct(frac)]] });
    }
    state.occupancy.push({ t: now, shares });
    while (state.occupancy.length && now - state.occupancy[0].t > WINDOW_MS)
      state.occupancy.shift();
    const series = tiers.filter((t) => t in shares).map((t) => ({
      color: TIER_COLORS[t],
      points: state.occupancy.filter((o) => t in o.shares).map((o) => [o.t, o.shares[t]]),
    }));
    // shares are small on a large tier: the axis grows from 1% to fit the largest one
    drawLines($('occupancy-chart'), series, now, 0.01,
              (v, step) => `${(v * 100).toFixed(Math.max(0, -Math.floor(Math.log10(step * 100))))}%`);
    const caption = !tiers.length ? 'the context cache is off (--no-cache)'
      : tiers.includes('redis') ? 'Redis is shared by instances: its size is not this server\'s ' +
                                  'to measure' : '';
    fillTable($('occupancy-table'), ['tier', 'chunks', 'used', 'capacity', 'share'], table,
              caption);
  }

  function showHits(m, tiers) {
    const rows = [];
    const table = [];
    for (const t of tiers) {
      const hits = sample(m, 'kvserve_cache_hits_total', { tier: t }) || 0;
      const misses = sample(m, 'kvserve_cache_misses_total', { tier: t }) || 0;
      const n = hits + misses;
      const rate = n ? hits / n : null;
      rows.push({ label: TIER_LABELS[t], frac: rate, color: TIER_COLORS[t], dim: !n,
                  text: n ? `${fmtPct(rate)} · ${fmtInt(hits)} of ${fmtInt(n)}` : 'no lookups' });
      table.push({ id: t, swatch: t, cells: [[null, TIER_LABELS[t]], ['hits', fmtInt(hits)],
                                  ['misses', fmtInt(misses)], ['rate', fmtPct(rate)]] });
    }
    drawRows($('hits-chart'), rows);
    fillTable($('hits-table'), ['tier', 'hits', 'misses', 'hit rate'], table);
  }

  function showTtft(m) {
    const name = 'kvserve_time_to_first_token_by_reuse_seconds';
    const hs = REUSE_CLASSES.map((c) => ({ c, h: histogram(m, name, { reuse: c.key }) }));
    if (hs.every((x) => !x.h)) {
      drawRows($('ttft-chart'), []);
      fillTable($('ttft-table'), [], [], `this server exports no ${name}`);
      return;
    }
    const stats = hs.map(({ c, h }) => {
      const n = h ? h.count : 0;
      return { c, n, mean: n ? h.sum / n : null, p50: quantile(h, 0.5), p90: quantile(h, 0.9) };
    });
    const top = Math.max(1e-3, ...stats.map((s) => Math.max(s.mean || 0, s.p90 || 0)));
    const rows = stats.map((s) => ({
      label: s.c.label, color: s.c.color, dim: !s.n,
      frac: s.n ? s.mean / top : null,
      tick: s.n ? s.p90 / top : null,
      text: s.n ? `mean ${fmtMs(s.mean * 1000)} · n ${fmtInt(s.n)}` : 'no requests yet',
    }));
    const base = stats[0].mean;
    const table = stats.map((s) => ({ id: s.c.key, swatch: `reuse-${s.c.key}`, cells: [
      [null, s.c.label], ['requests', fmtInt(s.n)], ['mean', fmtMs(s.mean && s.mean * 1000) || '–'],
      ['p50', fmtMs(s.p50 === null ? null : s.p50 * 1000) || '–'],
      ['p90', fmtMs(s.p90 === null ? null : s.p90 * 1000) || '–'],
      ['speedup', s.c.key !== 'none' && base && s.mean ? `${(base / s.mean).toFixed(1)}×` : '–'],
    ] }));
    drawRows($('ttft-chart'), rows);
    fillTable($('ttft-table'), ['prompt', 'requests', 'mean', 'p50', 'p90', 'vs no reuse'], table,
              'from the server (arrival to first token); p50/p90 interpolated in its buckets');
  }

  function showSummary(m) {
    const prompt = sample(m, 'kvserve_prompt_tokens_total');
    const reused = sample(m, 'kvserve_cache_reused_tokens_total');
    const el = $('reuse-summary');
    el.textContent = prompt === undefined ? '' : reused === undefined
      ? `${fmtInt(prompt)} prompt tokens processed`
      : `${fmtInt(reused)} of ${fmtInt(prompt)} prompt tokens came from the cache ` +
        `(${fmtPct(prompt ? reused / prompt : null)})`;
  }

  async function showSchemas(resp) {
    const table = $('schemas-table');
    if (!resp.ok) {
      fillTable(table, [], [], `${resp.status}: ${await errorMessage(resp)}`);
      return;
    }
    const list = await resp.json();
    const data = list && Array.isArray(list.data) ? list.data : [];
    const rows = data.map((s) => ({ id: s.name, cells: [
      [null, s.name], ['status', s.status], ['modules', fmtInt((s.modules || []).length)],
      ['tokens', fmtInt(s.tokens)], ['kv', fmtBytes(s.kv_bytes)],
      ['progress', fmtPct(s.progress ? s.progress.fraction : null)],
    ] }));
    fillTable(table, ['schema', 'status', 'modules', 'tokens', 'KV', 'built'], rows,
              rows.length ? '' : 'no schemas registered (POST /v1/schemas)');
  }

  async function poll() {
    state.pollTimer = null;
    if (state.polling) {
      state.pollAgain = true; // after this one: its numbers may predate the request
      return;
    }
    if (!state.model || !$('auth').hidden) return;
    state.polling = true;
    const problems = [];
    try {
      const [mr, sr, scr] = await Promise.all([api('/metrics'), api('/v1/cache/stats'),
                                               api('/v1/schemas')]);
      if (!mr.ok) throw new Error(`/metrics: ${mr.status}: ${await errorMessage(mr)}`);
      const m = parseMetrics(await mr.text());
      let stats = null;
      if (sr.ok) stats = await sr.json();
      else problems.push(`/v1/cache/stats: ${sr.status}: ${await errorMessage(sr)}`);
      const tiers = stats && stats.enabled === false ? [] : tiersOf(stats, m);
      showSummary(m);
      showOccupancy(stats, m, tiers);
      showHits(m, tiers);
      showTtft(m);
      await showSchemas(scr);
      const pane = $('cache-pane');
      pane.dataset.polls = String(Number(pane.dataset.polls) + 1);
      $('cache-updated').textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      if (!(e instanceof AuthError)) problems.push(e.message);
    } finally {
      state.polling = false;
    }
    $('cache-error').hidden = !problems.length;
    $('cache-error').textContent = problems.join('; ');
    pollSoon(state.pollAgain ? 0 : POLL_MS);
    state.pollAgain = false;
  }

  function pollSoon(ms) {
    if (state.pollTimer !== null) clearTimeout(state.pollTimer);
    state.pollTimer = setTimeout(() => {
      if (document.hidden) pollSoon(POLL_MS); // no work for a tab nobody looks at
      else poll();
    }, ms);
  }

  /* ------------------------------------------------------------ wiring */

  function start() {
    $('chat-form').addEventListener('submit', send);
    $('prompt').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        $('chat-form').requestSubmit();
      }
    });
    $('stop').addEventListener('click', stop);
    $('new-chat').addEventListener('click', newChat);
    $('key-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const key = $('key-input').value.trim();
      if (!key) return;
      // what the server accepts and a browser can send in a header
      if (/[^\x21-\x7e]/.test(key)) {
        $('auth-message').textContent = 'An API key is printable ASCII without spaces.';
        return;
      }
      storeKey(key);
      $('key-input').value = '';
      connect();
    });
    $('key-button').addEventListener('click', openKeyForm);
    $('key-forget').addEventListener('click', () => {
      storeKey('');
      $('auth-message').textContent = 'Key forgotten: requests go without one.';
    });
    $('key-cancel').addEventListener('click', () => {
      hideAuth();
      connect();
    });
    window.addEventListener('resize', () => pollSoon(100));
    document.addEventListener('visibilitychange', () => {
      if (!document.hidden) pollSoon(0);
    });
    connect();
  }

  start();
})();
