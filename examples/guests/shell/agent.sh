#!/usr/bin/env bash
# A hostcall guest in shell: bash and curl over the channel's Unix socket,
# nothing else. It reads its credential from the inherited fd, asks for the
# plan, makes one call, then retries that same call (same call_id) the way an
# agent retries a step it is unsure of: the host replays the stored result
# and the tool runs once.
#
#   hostcall run --plan examples/billing/plan.toml -- examples/guests/shell/agent.sh
#   agent.sh [TOOL [ARGS_JSON [CALL_ID]]]     (default: charge acct_alice 500 cents)
#
# Output, one line per request: LABEL HTTP_STATUS BODY (BODY is the JSON answer).
# Exit status: 0 when the call succeeded, 1 when it was refused or failed,
# 3 when its outcome is unknown, 75 when the host could not be reached.
# AGENT_REQUEST_TIMEOUT_S bounds each request (default 35 s).
# See docs/guests.md for what each answer means.
set -euo pipefail

TOOL=${1:-charge}
ARGS=${2:-'{"account": "acct_alice", "cents": 500}'}
CALL_ID=${3:-shell-charge-1}
ATTEMPTS=5                                     # transport failures tolerated per request
REQUEST_TIMEOUT=${AGENT_REQUEST_TIMEOUT_S:-35} # seconds for one request
# Seconds the host may hold a GET of an in-flight call: the request timeout
# less a grace for the answer to arrive, at most 60 (SPEC 4.2) - here 30.
POLL_WAIT=$(awk -v t="$REQUEST_TIMEOUT" 'BEGIN { g = (t / 2 < 5) ? t / 2 : 5; w = t - g;
    print (w > 30) ? 30 : w }')

for name in HOSTCALL_SOCKET HOSTCALL_INVOCATION HOSTCALL_EXECUTION HOSTCALL_PLAN; do
    if [ -z "${!name:-}" ]; then
        echo "agent.sh: $name is not set: not running as a hostcall guest" >&2
        exit 2
    fi
done

# The credential: read once, to EOF, from the fd the supervisor named, then
# close it. It never goes into argv or the environment of a child.
if [ -n "${HOSTCALL_CREDENTIAL_FD:-}" ]; then
    CREDENTIAL=$(cat <&"$HOSTCALL_CREDENTIAL_FD")
    exec {HOSTCALL_CREDENTIAL_FD}<&-
else
    CREDENTIAL=${HOSTCALL_CREDENTIAL:?"no HOSTCALL_CREDENTIAL_FD or HOSTCALL_CREDENTIAL"}
fi
unset HOSTCALL_CREDENTIAL

# The identity headers go to curl as a config on its stdin (printf is a bash
# builtin), so the credential is not in curl's argv, where `ps` would show it.
identity_config() {
    printf 'header = "Authorization: Bearer %s"\n' "$CREDENTIAL"
    printf 'header = "Hostcall-Invocation: %s"\n' "$HOSTCALL_INVOCATION"
    printf 'header = "Hostcall-Execution: %s"\n' "$HOSTCALL_EXECUTION"
    printf 'header = "Hostcall-Plan: %s"\n' "$HOSTCALL_PLAN"
}

# request METHOD PATH [BODY]: one request, resent (the same bytes) after a
# transport failure, with doubling pauses. Sets STATUS and BODY. Resending is
# safe: the host runs a call_id at most once.
request() {
    local method=$1 path=$2 data=${3-} out attempt=1 pause=0.1
    local args=(--silent --show-error --max-time "$REQUEST_TIMEOUT"
        --unix-socket "$HOSTCALL_SOCKET" --request "$method" --write-out '\n%{http_code}')
    if [ -n "$data" ]; then
        args+=(--header 'Content-Type: application/json' --data-binary "$data")
    fi
    until out=$(identity_config | curl "${args[@]}" --config - "http://hostcall$path"); do
        if [ "$attempt" -ge "$ATTEMPTS" ]; then
            echo "agent.sh: no answer after $attempt attempts; if this was a call it may" \
                "have run: retry it with the same call_id" >&2
            exit 75
        fi
        sleep "$pause"
        pause=$(awk -v p="$pause" 'BEGIN { print (p * 2 > 2) ? 2 : p * 2 }')
        attempt=$((attempt + 1))
    done
    STATUS=${out##*$'\n'}
    BODY=${out%$'\n'*}
}

# field NAME: the first "NAME":"value" of BODY. The host writes compact JSON
# with the envelope's fields (status, call_id, tool, effect, reason) before
# `result`, so the first match is the envelope's. Real guests: use jq.
field() {
    grep -o "\"$1\":\"[^\"]*\"" <<<"$BODY" | head -n 1 | cut -d '"' -f 4
}

# call LABEL: POST the call; while it is in flight, long-poll it. Prints
# "LABEL STATUS BODY" and returns 0 (ok), 1 (refused or failed) or 3 (unknown).
call() {
    local label=$1
    request POST /v1/calls "{\"call_id\": \"$CALL_ID\", \"tool\": \"$TOOL\", \"args\": $ARGS}"
    while [ "$(field status)" = ambiguous ] && [ "$(field reason)" = in_flight ] ||
        [ "$(field status)" = awaiting_approval ]; do
        request GET "/v1/calls/$CALL_ID?wait=$POLL_WAIT"
    done
    echo "$label $STATUS $BODY"
    case "$(field effect)" in
        executed | replayed) [ "$(field status)" = ok ] && return 0 || return 1 ;;
        none | failed) return 1 ;;  # did not run / ran and failed: safe to retry
        *) return 3 ;;              # may have run: ask the backend, never re-run
    esac
}

request GET /v1/plan
echo "plan $STATUS $BODY"
[ "$STATUS" = 200 ] || exit 1

call call || exit $?
call retry || exit $?
