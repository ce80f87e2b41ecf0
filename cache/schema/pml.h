/* PML, Prompt Cache's markup (Gim et al., MLSys'24, section 3.2), parsed with expat into a
 * tree (internal to cache/; cache/schema/schema.h is the public contract).
 *
 * A schema declares the reusable parts of prompts:
 *
 *   <schema name="travel">
 *     <system>You are a travel agent.</system>
 *     <user>
 *       <module name="plan">Plan a trip of <parameter name="days" length="4"/> days.</module>
 *       <union>
 *         <module name="tokyo">Tokyo is ...</module>
 *         <module name="miami">Miami is ...</module>
 *       </union>
 *     </user>
 *   </schema>
 *
 * and a prompt picks from one:
 *
 *   <prompt schema="travel"><plan days="3"/><miami/><user>Where should I surf?</user></prompt>
 *
 * Schema elements: <module name> (nestable; text outside modules is always included),
 * <parameter name length> (inside a module: a placeholder of at most length tokens), <union>
 * (modules only: they share their start position, a prompt takes at most one), and the role tags
 * <system>, <user>, <assistant> (rendered with the model's chat template; not nested in each
 * other). Prompt elements: role tags holding text, and module references by the module's name
 * with its parameters' values as attributes, nested as the modules are. Text is kept as written
 * except that whitespace containing a line break is dropped at either end of a text run (the
 * indentation between elements). DOCTYPE declarations (and so entities) are refused. */
#ifndef KVSERVE_CACHE_PML_H
#define KVSERVE_CACHE_PML_H

#include <stdbool.h>
#include <stddef.h>

#include "util/util.h"

typedef enum pml_kind {
    PML_TEXT = 0, /* characters */
    PML_MODULE,   /* schema: <module name>; prompt: a reference <NAME param="value" ...> */
    PML_UNION,    /* schema only */
    PML_PARAM,    /* schema only: <parameter name length> */
    PML_ROLE,     /* <system>, <user>, <assistant> */
} pml_kind;

typedef enum pml_role {
    PML_ROLE_SYSTEM = 0,
    PML_ROLE_USER,
    PML_ROLE_ASSISTANT,
} pml_role;

typedef struct pml_node {
    pml_kind kind;
    int line, col; /* where its start tag (or text) begins, 1-based */
    char *name;    /* module or parameter name */
    char *text;    /* PML_TEXT: UTF-8, NUL-terminated */
    size_t len;
    int length;    /* PML_PARAM: the most tokens a value may have */
    pml_role role; /* PML_ROLE */
    char **args;   /* a prompt's module reference: [n_args][2] name, value */
    int n_args;
    struct pml_node **kids;
    int n_kids, cap_kids;
} pml_node;

typedef struct pml_doc {
    bool prompt; /* <prompt schema> (else <schema name>) */
    char *name;  /* the schema's name (a prompt: the schema it names) */
    pml_node root;
} pml_doc;

typedef struct pml_limits {
    size_t max_bytes;  /* source size */
    int max_depth;     /* element nesting */
    int max_nodes;     /* elements and text runs */
    int max_param_len; /* a parameter's length attribute */
} pml_limits;

void pml_limits_default(pml_limits *l);

/* Names of modules, parameters and schemas: a letter or '_', then up to 63 letters, digits, '_',
 * '-' or '.' (an XML name, so a prompt can use a module's name as its tag). */
bool pml_name_ok(const char *s);
/* True for the element names PML reserves (schema, prompt, module, union, parameter, and the
 * role tags): no module may take one. */
bool pml_reserved(const char *s);

/* Parses src[0..len). NULL with err ("line L, column C: what is wrong") on malformed XML, an
 * unknown element or attribute, a structure PML does not allow, or a limit passed. */
pml_doc *pml_parse(const char *src, size_t len, const pml_limits *lim, kv_error *err);
void pml_free(pml_doc *d);

#endif
