#!/usr/bin/env node
// A hostcall guest in Node.js, with no npm dependencies: node:http over the
// channel's Unix socket. It reads its credential from the inherited fd, asks
// for the plan, makes one call, then retries that same call (same call_id)
// the way an agent retries a step it is unsure of: the host replays the
// stored result and the tool runs once.
//
//   hostcall run --plan examples/billing/plan.toml -- node examples/guests/node/agent.mjs
//   node agent.mjs [TOOL [ARGS_JSON [CALL_ID]]]   (default: charge acct_alice 500 cents)
//
// Output: one JSON line per request, {"label", "http", "body"}.
// Exit status: 0 when the call succeeded, 1 when it was refused or failed,
// 3 when its outcome is unknown, 75 when the host could not be reached.
// AGENT_REQUEST_TIMEOUT_S bounds each request (default 35 s).
// See docs/guests.md for what each answer means.

import fs from "node:fs";
import http from "node:http";
import { setTimeout as sleep } from "node:timers/promises";

const ATTEMPTS = 5; // transport failures tolerated per request
const REQUEST_TIMEOUT_S = Number(process.env.AGENT_REQUEST_TIMEOUT_S ?? 35);
// Seconds the host may hold a GET of an in-flight call: the request timeout
// less a grace for the answer to arrive, at most 60 (SPEC 4.2) - here 30.
const POLL_WAIT_S = Math.min(30, REQUEST_TIMEOUT_S - Math.min(5, REQUEST_TIMEOUT_S / 2));

/** Outcomes by what happened to the tool's effect (SPEC 4.3). */
class HostcallError extends Error {
  constructor(message, { code, callId, idempotencyKey, http, body, exit }) {
    super(message);
    Object.assign(this, { code, callId, idempotencyKey, http, body, exit });
  }
}

function guestEnvironment() {
  const env = process.env;
  for (const name of ["HOSTCALL_SOCKET", "HOSTCALL_INVOCATION", "HOSTCALL_EXECUTION", "HOSTCALL_PLAN"]) {
    if (!env[name]) {
      throw new HostcallError(`${name} is not set: not running as a hostcall guest`, {
        code: "not_a_guest",
        exit: 2,
      });
    }
  }
  let credential;
  if (env.HOSTCALL_CREDENTIAL_FD) {
    // Read once, to EOF, then close: the supervisor wrote it and closed its end.
    const fd = Number(env.HOSTCALL_CREDENTIAL_FD);
    credential = fs.readFileSync(fd, "ascii").trim();
    fs.closeSync(fd);
  } else {
    credential = (env.HOSTCALL_CREDENTIAL ?? "").trim();
  }
  delete env.HOSTCALL_CREDENTIAL; // never handed down to a child
  if (!credential) {
    throw new HostcallError("no credential", { code: "not_a_guest", exit: 2 });
  }
  return {
    socketPath: env.HOSTCALL_SOCKET,
    headers: {
      Authorization: `Bearer ${credential}`,
      "Hostcall-Invocation": env.HOSTCALL_INVOCATION,
      "Hostcall-Execution": env.HOSTCALL_EXECUTION,
      "Hostcall-Plan": env.HOSTCALL_PLAN,
    },
  };
}

class HostClient {
  constructor({ socketPath, headers }) {
    this.socketPath = socketPath;
    this.headers = headers;
    // Kept-alive connections, as the channel allows.
    this.agent = new http.Agent({ keepAlive: true });
  }

  /** One HTTP exchange; resolves {status, body} or rejects on a transport failure. */
  exchange(method, path, data) {
    return new Promise((resolve, reject) => {
      const headers = { ...this.headers, Accept: "application/json" };
      if (data !== undefined) {
        headers["Content-Type"] = "application/json";
        headers["Content-Length"] = Buffer.byteLength(data);
      }
      const req = http.request(
        { socketPath: this.socketPath, path, method, headers, agent: this.agent },
        (res) => {
          const chunks = [];
          res.on("data", (chunk) => chunks.push(chunk));
          res.on("error", reject);
          res.on("end", () => {
            try {
              resolve({ status: res.statusCode, body: JSON.parse(Buffer.concat(chunks)) });
            } catch (error) {
              reject(error);
            }
          });
        },
      );
      req.setTimeout(REQUEST_TIMEOUT_S * 1000, () => req.destroy(new Error("timed out")));
      req.on("error", reject);
      req.end(data);
    });
  }

  /** A request, resent (the same bytes) after transport failures with backoff. */
  async request(method, path, data, callId) {
    let pause = 100;
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.exchange(method, path, data);
      } catch (error) {
        if (attempt >= ATTEMPTS) {
          throw new HostcallError(
            `no answer after ${attempt} attempts (${error.message}); the call may have run: ` +
              "retrying with the same call_id is safe",
            { code: "transport_error", callId, exit: 75 },
          );
        }
        await sleep(Math.random() * pause); // full jitter
        pause = Math.min(pause * 2, 2000);
      }
    }
  }

  plan() {
    return this.request("GET", "/v1/plan");
  }

  /**
   * Make a call under `callId`; long-poll it while it is in flight. Resolves
   * the final {status, body}; throws a HostcallError for anything but `ok`.
   */
  async call(tool, args, callId) {
    const data = JSON.stringify({ call_id: callId, tool, args });
    let reply = await this.request("POST", "/v1/calls", data, callId);
    while (
      (reply.body.status === "ambiguous" && reply.body.reason === "in_flight") ||
      reply.body.status === "awaiting_approval"
    ) {
      reply = await this.request("GET", `/v1/calls/${callId}?wait=${POLL_WAIT_S}`, undefined, callId);
    }
    const { status, effect, error, idempotency_key: idempotencyKey } = reply.body;
    if (status === "ok") return reply;
    const context = { callId, idempotencyKey, http: reply.status, body: reply.body };
    if (effect === "none") {
      // Did not run: fix the cause (arguments, budget, ...) and call again.
      throw new HostcallError(`refused: ${error?.code}`, { ...context, code: error?.code, exit: 1 });
    }
    if (effect === "failed") {
      // Ran and failed; nothing in doubt: calling again is safe.
      throw new HostcallError(`tool error: ${error?.message}`, { ...context, code: "tool_error", exit: 1 });
    }
    // unknown (ambiguous), or executed/replayed with result_invalid: the effect
    // may have happened. Never re-run under a new call_id; ask the backend.
    throw new HostcallError(`outcome unknown; ask the backend about ${idempotencyKey}`, {
      ...context,
      code: error?.code ?? "ambiguous",
      exit: 3,
    });
  }

  close() {
    this.agent.destroy();
  }
}

function report(label, reply) {
  console.log(JSON.stringify({ label, http: reply.status, body: reply.body }));
}

async function main() {
  const [tool = "charge", argsJson, callId = "node-charge-1"] = process.argv.slice(2);
  const args = argsJson ? JSON.parse(argsJson) : { account: "acct_alice", cents: 500 };
  let client;
  try {
    client = new HostClient(guestEnvironment());
    const plan = await client.plan();
    report("plan", plan);
    if (plan.status !== 200) return 1;
    report("call", await client.call(tool, args, callId));
    // The same step again, as after a crash or a lost answer: same call_id.
    report("retry", await client.call(tool, args, callId));
    return 0;
  } catch (error) {
    if (!(error instanceof HostcallError)) throw error;
    if (error.body !== undefined) report("error", { status: error.http, body: error.body });
    console.error(`agent.mjs: ${error.message} (call_id=${error.callId ?? "-"})`);
    return error.exit;
  } finally {
    client?.close();
  }
}

process.exitCode = await main();
