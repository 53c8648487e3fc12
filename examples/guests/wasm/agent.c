/* A hostcall guest in C, compiled to WebAssembly (WASI preview 1).
 *
 * It calls host tools through the `hostcall` import module, not a socket
 * (docs/wasm.md): each import takes the same JSON as the HTTP endpoint of the
 * same name and answers with its HTTP status. Build it with the compiler in
 * the `ziglang` wheel:
 *
 *     python -m ziglang cc -target wasm32-wasi -O2 agent.c -o agent.wasm
 *
 * Modes (argv):
 *   steps STEP...    each STEP one of
 *                      call:CALL_ID:TOOL:ARGS_JSON   POST /v1/calls
 *                      status:CALL_ID[:WAIT_MS]      GET /v1/calls/{id}[?wait=]
 *                      plan                          GET /v1/plan
 *                    and prints "<http status> <reply body>" per step
 *   bench TOOL SECONDS [WARMUP]  calls TOOL ({"n": i}) one at a time for WARMUP
 *                    seconds (default 0), then for SECONDS, measured, and prints
 *                    {"calls": N, "seconds": .., "p50_us": .., "p99_us": ..}
 *   calls FILE OUT   makes the calls of FILE, one "CALL_ID TOOL ARGS_JSON" per line,
 *                    appending "<http status> <reply body>" per call to OUT
 *   env              prints its argv and environment, one per line
 *   write PATH TEXT  writes TEXT to PATH (a preopened folder's), exits 5 if it cannot
 *   spin             burns CPU until stopped
 *   sleep SECONDS    sleeps (WASI's poll_oneoff), then prints "slept <seconds measured>"
 *   grow MIB         allocates MIB MiB a MiB at a time, touching every page
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define IMPORT(name) __attribute__((import_module("hostcall"), import_name(name)))

/* Each writes the reply into [reply, reply + cap) when it fits, and its full
 * length into *reply_len either way; the return value is the HTTP status. */
IMPORT("call") int32_t hostcall_call(const char *request, int32_t request_len, char *reply,
                                     int32_t cap, uint32_t *reply_len);
IMPORT("status") int32_t hostcall_status(const char *call_id, int32_t call_id_len,
                                         int32_t wait_ms, char *reply, int32_t cap,
                                         uint32_t *reply_len);
IMPORT("plan") int32_t hostcall_plan(char *reply, int32_t cap, uint32_t *reply_len);
/* The last reply again, for a buffer that was too small: its length, or
 * minus the length needed when this buffer is too small as well. */
IMPORT("reply") int32_t hostcall_reply(char *reply, int32_t cap);

static char *buffer;
static int32_t capacity = 256; /* small on purpose: large replies take the reply() path */

/* The reply of the last import call, fetched whole. */
static const char *whole_reply(uint32_t length) {
    if ((int64_t)length > capacity) {
        capacity = (int32_t)length;
        buffer = realloc(buffer, (size_t)capacity + 1);
        if (buffer == NULL || hostcall_reply(buffer, capacity) != (int32_t)length) {
            fprintf(stderr, "agent: cannot fetch a reply of %u bytes\n", length);
            exit(3);
        }
    }
    buffer[length] = '\0';
    return buffer;
}

static int32_t call(const char *call_id, const char *tool, const char *args, const char **out) {
    size_t size = strlen(call_id) + strlen(tool) + strlen(args) + 64;
    char *request = malloc(size);
    int written = snprintf(request, size, "{\"call_id\":\"%s\",\"tool\":\"%s\",\"args\":%s}",
                           call_id, tool, args);
    uint32_t length = 0;
    int32_t status = hostcall_call(request, written, buffer, capacity, &length);
    free(request);
    *out = whole_reply(length);
    return status;
}

static int steps(int count, char **items) {
    for (int i = 0; i < count; i++) {
        char *item = items[i];
        const char *reply = "";
        int32_t status;
        uint32_t length = 0;
        if (strncmp(item, "call:", 5) == 0) {
            char *call_id = item + 5;
            char *tool = strchr(call_id, ':');
            if (tool == NULL) return 2;
            *tool++ = '\0';
            char *args = strchr(tool, ':');
            if (args == NULL) return 2;
            *args++ = '\0';
            status = call(call_id, tool, args, &reply);
        } else if (strncmp(item, "status:", 7) == 0) {
            char *call_id = item + 7;
            char *wait = strchr(call_id, ':');
            int32_t wait_ms = 0;
            if (wait != NULL) {
                *wait++ = '\0';
                wait_ms = atoi(wait);
            }
            status = hostcall_status(call_id, (int32_t)strlen(call_id), wait_ms, buffer, capacity,
                                     &length);
            reply = whole_reply(length);
        } else if (strcmp(item, "plan") == 0) {
            status = hostcall_plan(buffer, capacity, &length);
            reply = whole_reply(length);
        } else {
            fprintf(stderr, "agent: unknown step %s\n", item);
            return 2;
        }
        printf("%d %s\n", status, reply);
        fflush(stdout);
    }
    return 0;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int bench(const char *tool, double seconds, double warmup) {
    size_t room = 1 << 16, calls = 0, made = 0;
    double *took = malloc(room * sizeof(double));
    double measured = now_us() + warmup * 1e6;
    double end = measured + seconds * 1e6;
    char call_id[32], args[32];
    for (double at = now_us(); at < end; at = now_us()) {
        snprintf(call_id, sizeof call_id, "b%zu", made);
        snprintf(args, sizeof args, "{\"n\":%zu}", made++);
        const char *reply;
        double started = now_us();
        if (call(call_id, tool, args, &reply) != 200) {
            fprintf(stderr, "agent: %s\n", reply);
            return 1;
        }
        if (started < measured) continue; /* warming up */
        if (calls == room) {
            room *= 2;
            took = realloc(took, room * sizeof(double));
        }
        took[calls++] = now_us() - started;
    }
    qsort(took, calls, sizeof(double), compare);
    printf("{\"calls\": %zu, \"seconds\": %.3f, \"p50_us\": %.1f, \"p99_us\": %.1f}\n", calls,
           seconds, calls ? took[calls / 2] : 0.0, calls ? took[(calls * 99) / 100] : 0.0);
    return 0;
}

/* The fault harness's guest (scripts/faults --guest wasm). */
static int calls(const char *path, const char *out_path) {
    FILE *in = fopen(path, "r");
    FILE *out = fopen(out_path, "a");
    if (in == NULL || out == NULL) {
        fprintf(stderr, "agent: cannot open %s or %s\n", path, out_path);
        return 5;
    }
    static char line[65536];
    while (fgets(line, sizeof line, in) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        char *tool = strchr(line, ' ');
        if (tool == NULL) continue;
        *tool++ = '\0';
        char *args = strchr(tool, ' ');
        if (args == NULL) continue;
        *args++ = '\0';
        const char *reply;
        int32_t status = call(line, tool, args, &reply);
        fprintf(out, "%d %s\n", status, reply);
        fflush(out); /* what it was told is on disk before the next call */
    }
    fclose(out);
    return 0;
}

extern char **environ;

int main(int argc, char **argv) {
    buffer = malloc((size_t)capacity + 1);
    if (argc >= 2 && strcmp(argv[1], "steps") == 0) return steps(argc - 2, argv + 2);
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "bench") == 0)
        return bench(argv[2], atof(argv[3]), argc == 5 ? atof(argv[4]) : 0.0);
    if (argc == 4 && strcmp(argv[1], "calls") == 0) return calls(argv[2], argv[3]);
    if (argc == 2 && strcmp(argv[1], "env") == 0) {
        for (int i = 0; i < argc; i++) printf("argv %s\n", argv[i]);
        for (char **name = environ; *name != NULL; name++) printf("env %s\n", *name);
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "write") == 0) {
        FILE *file = fopen(argv[2], "w");
        if (file == NULL || fputs(argv[3], file) < 0 || fclose(file) != 0) {
            perror("agent: write");
            return 5;
        }
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "spin") == 0) {
        volatile uint64_t n = 0;
        for (;;) n++;
    }
    if (argc == 3 && strcmp(argv[1], "sleep") == 0) {
        /* nanosleep is WASI's poll_oneoff with one relative clock. */
        double seconds = atof(argv[2]);
        struct timespec wait = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
        struct timespec start, end;
        clock_gettime(CLOCK_MONOTONIC, &start);
        if (nanosleep(&wait, NULL) != 0) {
            perror("agent: sleep");
            return 6;
        }
        clock_gettime(CLOCK_MONOTONIC, &end);
        printf("slept %.3f\n",
               (double)(end.tv_sec - start.tv_sec) + (double)(end.tv_nsec - start.tv_nsec) / 1e9);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "grow") == 0) {
        /* A MiB at a time, as a program that keeps allocating does. */
        for (int mib = 0; mib < atoi(argv[2]); mib++) {
            volatile char *block = malloc(1 << 20);
            if (block == NULL) {
                fprintf(stderr, "agent: out of memory after %d MiB\n", mib);
                return 4;
            }
            for (size_t i = 0; i < (1 << 20); i += 4096) block[i] = 1;
        }
        return 0;
    }
    fprintf(stderr, "usage: agent.wasm steps STEP... | bench TOOL SECONDS | calls FILE OUT | env"
                    " | write PATH TEXT | spin | sleep SECONDS | grow MIB\n");
    return 2;
}
