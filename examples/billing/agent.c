/* The billing example's agent as a WebAssembly guest (`hostcall demo --wasm`).
 *
 * The same five steps as agent.py, in C, calling host tools through the
 * `hostcall` imports instead of the Unix socket (docs/wasm.md). Built with
 * the C compiler of the `ziglang` wheel:
 *
 *     python -m ziglang cc -target wasm32-wasi -O2 -s agent.c -o agent.wasm
 *
 * It exits 0 when every step behaved as described, 1 otherwise.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IMPORT(name) __attribute__((import_module("hostcall"), import_name(name)))

IMPORT("call") int32_t hostcall_call(const char *request, int32_t request_len, char *reply,
                                     int32_t cap, uint32_t *reply_len);
IMPORT("reply") int32_t hostcall_reply(char *reply, int32_t cap);

static char *reply;
static int32_t capacity = 4096;

/* One call: the HTTP status; the reply (NUL-terminated) in `reply`. */
static int32_t call(const char *call_id, const char *tool, const char *args) {
    char request[1024];
    int size = snprintf(request, sizeof request, "{\"call_id\":\"%s\",\"tool\":\"%s\",\"args\":%s}",
                        call_id, tool, args);
    uint32_t length = 0;
    int32_t status = hostcall_call(request, size, reply, capacity, &length);
    if ((int64_t)length > capacity) { /* too big for the buffer: fetch it whole */
        capacity = (int32_t)length;
        reply = realloc(reply, (size_t)capacity + 1);
        if (reply == NULL || hostcall_reply(reply, capacity) != (int32_t)length) exit(3);
    }
    reply[length] = '\0';
    return status;
}

/* The string value of "key" in the last reply (a flat search: enough here). */
static const char *text(const char *key) {
    static char value[256];
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\":\"", key);
    const char *start = strstr(reply, pattern);
    if (start == NULL) return "?";
    start += strlen(pattern);
    size_t n = strcspn(start, "\"");
    if (n >= sizeof value) n = sizeof value - 1;
    memcpy(value, start, n);
    value[n] = '\0';
    return value;
}

static long number(const char *key) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *start = strstr(reply, pattern);
    return start == NULL ? -1 : strtol(start + strlen(pattern), NULL, 10);
}

static void fail(const char *what) {
    printf("   UNEXPECTED: %s\n   host said: %s\n", what, reply);
    exit(1);
}

static void step_executed(void) {
    puts("1. A call is executed");
    if (call("charge-1001", "charge",
             "{\"account\":\"acct_alice\",\"cents\":1250,\"memo\":\"order 1001\"}") != 200)
        fail("the charge was not executed");
    printf("   charge acct_alice 1250 cents (call_id charge-1001) -> %s\n", text("charge_id"));
    printf("   acct_alice balance is now %ld cents\n", number("balance_cents"));
}

static void step_replayed(void) {
    puts("2. A lost response, retried with the same call_id");
    if (call("balance-bob-before", "read_balance", "{\"account\":\"acct_bob\"}") != 200)
        fail("read_balance failed");
    long before = number("result");
    const char *args = "{\"account\":\"acct_bob\",\"cents\":800,\"memo\":\"order 1002\"}";
    call("charge-1002", "charge", args); /* its answer "lost": not read */
    puts("   charge acct_bob 800 cents (call_id charge-1002): answer dropped unread");
    if (call("charge-1002", "charge", args) != 200 || strcmp(text("effect"), "replayed") != 0)
        fail("the retry was not replayed");
    printf("   retry with call_id charge-1002 -> %s (the stored result)\n", text("charge_id"));
    if (call("balance-bob-after", "read_balance", "{\"account\":\"acct_bob\"}") != 200)
        fail("read_balance failed");
    long after = number("result");
    if (before - after != 800) fail("acct_bob was charged more than once");
    printf("   acct_bob balance %ld -> %ld cents: charged once, not twice\n", before, after);
}

static void step_refused(void) {
    puts("3. Refused calls: nothing runs");
    if (call("delete-alice", "delete_account", "{\"account\":\"acct_alice\"}") != 403)
        fail("delete_account was not refused");
    printf("   delete_account (not in the plan) -> Refused %s\n", text("code"));
    const char *bad = "{\"account\":\"alice\",\"cents\":-5,\"currency\":\"EUR\"}";
    if (call("charge-bad", "charge", bad) != 422) fail("a charge with bad arguments ran");
    int problems = 0;
    for (const char *at = reply; (at = strstr(at, "\"loc\"")) != NULL; at++) problems++;
    printf("   charge %s\n     -> Refused %s (%d problems)\n", bad, text("code"), problems);
}

static void step_unknown(void) {
    puts("4. An ambiguous outcome: the mail server hung up");
    const char *args = "{\"account\":\"acct_alice\",\"email\":\"alice@example.com\"}";
    const char *attempts[] = {"send_receipt", "retry, same call_id"};
    for (int i = 0; i < 2; i++) {
        if (call("receipt-1001", "send_receipt", args) != 409) fail("send_receipt was not ambiguous");
        char key[17];
        snprintf(key, sizeof key, "%s", text("idempotency_key"));
        printf("   %s -> ambiguous (%s), idempotency_key %s…\n", attempts[i], text("reason"), key);
    }
    puts("   the host will not send it again; ask the mail backend about that key");
}

static void step_approval(void) {
    puts("5. A call that needs an operator's approval");
    puts("   refund acct_bob 800 cents (call_id refund-1002): waiting for a decision…");
    fflush(stdout);
    /* The import blocks until the proposal is decided or its lease runs out. */
    int32_t status = call("refund-1002", "refund",
                          "{\"account\":\"acct_bob\",\"cents\":800,\"memo\":\"refund of order 1002\"}");
    if (status == 200) {
        printf("   -> approved and executed: %s, acct_bob balance is now %ld cents\n",
               text("refund_id"), number("balance_cents"));
        return;
    }
    char code[64];
    snprintf(code, sizeof code, "%s", text("code"));
    if (strcmp(code, "approval_rejected") != 0 && strcmp(code, "approval_expired") != 0)
        fail("the refund was refused for another reason");
    if (call("balance-bob-end", "read_balance", "{\"account\":\"acct_bob\"}") != 200)
        fail("read_balance failed");
    printf("   -> Refused %s: nothing ran, acct_bob balance stays %ld cents\n", code,
           number("result"));
}

int main(void) {
    reply = malloc((size_t)capacity + 1);
    const char *invocation = getenv("HOSTCALL_INVOCATION");
    printf("agent: a WebAssembly guest of invocation %s\n", invocation ? invocation : "?");
    step_executed();
    step_replayed();
    step_refused();
    step_unknown();
    step_approval();
    return 0;
}
