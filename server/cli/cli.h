/* Command-line entry points of the kvserve binary (server/cli/main.c dispatches to them). */
#ifndef KVSERVE_CLI_H
#define KVSERVE_CLI_H

int cli_generate(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_serve(int argc, char **argv);
int cli_calibrate(int argc, char **argv);
int cli_codec_eval(int argc, char **argv);

#endif
