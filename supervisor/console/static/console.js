// The hostcall operator console. No framework, no build step.
//
// Safety rule of this file: every string that comes from the server is put on
// the page as text (text nodes, textContent, attribute values), never parsed
// as HTML. Guest-supplied text (arguments, results, log lines) is hostile.
"use strict";

const TOKEN = document.querySelector('meta[name="hostcall-token"]').content;
const OUTCOMES = ["executed", "replayed", "refused", "failed", "unknown", "result_invalid"];
const COLOURS = {
  executed: "#1f8a4c", replayed: "#2f5bd3", refused: "#c53030",
  failed: "#b7791f", unknown: "#9f580a", result_invalid: "#7c3aed",
};

// -- small helpers -----------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function chip(text, kind) { return el("span", { class: `chip ${kind || ""}` }, text); }

// Arguments are what an operator decides an approval on. A guest can hide
// text in them from a person: a right-to-left override shows what follows it
// reversed, zero-width, tag characters and variation selectors are
// invisible. So every control, format character, surrogate, line or
// paragraph separator and default-ignorable character is shown as the JSON
// escape it stands for (the same JSON value); JSON.stringify has already
// escaped C0 controls, so a newline here is the indentation's.
const UNSEEN = /[\p{Cc}\p{Cf}\p{Cs}\p{Zl}\p{Zp}\p{Default_Ignorable_Code_Point}]/gu;
function unitEscapes(char) {
  let escaped = "";
  for (let i = 0; i < char.length; i++) escaped += "\\u" + char.charCodeAt(i).toString(16).padStart(4, "0");
  return escaped;
}
// Indented as JSON.stringify(value, null, 2) does, but only the first
// INDENT_LEVELS levels: deeper ones stay compact. Indented whole, a megabyte
// nested 250 deep is some 260 million characters (a guest's arguments).
const INDENT_LEVELS = 8;
function indented(value, depth) {
  if (value === null || typeof value !== "object" || depth >= INDENT_LEVELS) return JSON.stringify(value);
  const pad = "  ".repeat(depth + 1);
  const items = Array.isArray(value)
    ? value.map((item) => pad + indented(item, depth + 1))
    : Object.keys(value).map((key) => `${pad}${JSON.stringify(key)}: ${indented(value[key], depth + 1)}`);
  const [open, close] = Array.isArray(value) ? ["[", "]"] : ["{", "}"];
  return items.length ? `${open}\n${items.join(",\n")}\n${"  ".repeat(depth)}${close}` : open + close;
}
function pretty(value) { return visible(indented(value, 0)); }
function visible(json) { return json.replace(UNSEEN, (char) => (char === "\n" ? char : unitEscapes(char))); }
// Other text a guest chose (a tool name it made up, refused but recorded), the same way.
function inert(text) { return String(text ?? "").replace(UNSEEN, unitEscapes); }
function short(text, n) { text = String(text ?? ""); return text.length > n ? text.slice(0, n - 1) + "…" : text; }

let clockSkewMs = 0; // server time − browser time
function serverNow() { return Date.now() + clockSkewMs; }
function noteServerTime(seconds) { if (typeof seconds === "number") clockSkewMs = seconds * 1000 - Date.now(); }

function leftText(ms) {
  if (ms <= 0) return "lapsed";
  const s = Math.floor(ms / 1000);
  const m = Math.floor(s / 60);
  return m ? `${m} min ${s % 60} s left` : `${s} s left`;
}

async function api(path, options) {
  const init = Object.assign({ headers: {} }, options || {});
  init.headers["X-Hostcall-Token"] = TOKEN;
  if (init.body !== undefined) init.headers["Content-Type"] = "application/json";
  const response = await fetch(path, init);
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok) {
    const message = body && body.error ? body.error.message : `HTTP ${response.status}`;
    throw new Error(message);
  }
  return body;
}

// -- state and routing ---------------------------------------------------------

const state = { overview: null, invocation: null, receipts: null, metrics: null, error: null };
const notes = {}; // proposal id -> message after a decision
const wholeArgs = {}; // proposal id -> its arguments asked for whole (the overview previews large ones), as shown

function route() {
  const hash = location.hash.replace(/^#/, "") || "invocations";
  const [view, ...rest] = hash.split("/");
  return { view, id: rest.length ? decodeURIComponent(rest.join("/")) : null };
}

async function load(what) {
  const { view, id } = route();
  try {
    if (what.has("overview")) {
      state.overview = await api("/api/overview");
      noteServerTime(state.overview.now);
    }
    if (what.has("invocation") && view === "invocation" && id) {
      state.invocation = await api(`/api/invocations/${encodeURIComponent(id)}`);
    }
    if (what.has("receipts") && view === "receipts") state.receipts = await api("/api/receipts");
    if (what.has("metrics") && view === "metrics") state.metrics = await api("/api/metrics");
    state.error = null;
  } catch (error) {
    state.error = error.message;
  }
  render();
}

// Notices name what changed; reloads are coalesced (at most one in flight).
let pending = new Set(["overview", "invocation", "receipts", "metrics"]);
let loading = false;
function want(...parts) {
  for (const part of parts) pending.add(part);
  if (loading) return;
  loading = true;
  setTimeout(async () => {
    const what = pending;
    pending = new Set();
    await load(what);
    loading = false;
    if (pending.size) want();
  }, 60);
}

// Verifying receipts reads whole files: while calls stream in, at most every 5 s.
let receiptsTimer = null;
function wantReceipts() {
  if (receiptsTimer === null) receiptsTimer = setTimeout(() => { receiptsTimer = null; want("receipts"); }, 5000);
}

function onNotice(notice) {
  const { view, id } = route();
  switch (notice.topic) {
    case "approvals": want("overview"); break;
    case "invocations": want("overview", "invocation"); if (view === "receipts") wantReceipts(); break;
    case "calls":
      want("overview");
      if (view === "invocation" && notice.invocation_id === id) want("invocation");
      if (view === "receipts") wantReceipts();
      break;
    case "logs": if (view === "invocation" && notice.invocation_id === id) want("invocation"); break;
    case "metrics": if (view === "metrics") want("metrics"); break;
    default: want("overview", "invocation", "receipts", "metrics");
  }
}

function connect() {
  const status = document.getElementById("connection");
  const source = new EventSource(`/events?token=${encodeURIComponent(TOKEN)}`);
  source.addEventListener("hello", () => {
    status.textContent = "live"; status.className = "connection live";
    want("overview", "invocation", "receipts", "metrics");
  });
  source.onmessage = (event) => { try { onNotice(JSON.parse(event.data)); } catch (_) { /* ignore */ } };
  source.onerror = () => { status.textContent = "reconnecting…"; status.className = "connection down"; };
}

// -- views -----------------------------------------------------------------------

// A render replaces the view's nodes. It waits while the operator types a
// reason (it would wipe the text) or holds a button down: a button replaced
// between its mousedown and mouseup gets no click, so a decision made just as
// a notice arrived would be lost. The wait is bounded (POINTER_HOLD_MS), and
// the skipped render runs once the operator lets go.
const POINTER_HOLD_MS = 5000;
let pointerDownAt = null;
let deferred = false;
function operatorBusy() {
  const focused = document.activeElement;
  if (focused && focused.classList.contains("reason")) return true;
  return pointerDownAt !== null && Date.now() - pointerDownAt < POINTER_HOLD_MS;
}
function renderIfDeferred() { if (deferred) render(); }
function released() {
  pointerDownAt = null;
  setTimeout(renderIfDeferred, 0); // after this press's click event
}
document.addEventListener("pointerdown", () => { pointerDownAt = Date.now(); }, true);
document.addEventListener("pointerup", released, true);
document.addEventListener("pointercancel", released, true);
window.addEventListener("blur", released);
document.addEventListener("focusout", () => setTimeout(renderIfDeferred, 0));

function render() {
  const { view, id } = route();
  for (const link of document.querySelectorAll("nav a")) {
    const active = link.dataset.view === view || (view === "invocation" && link.dataset.view === "invocations");
    link.classList.toggle("active", active);
  }
  const waiting = (state.overview?.approvals || []).filter((p) => p.state === "waiting").length;
  const badge = document.getElementById("waiting-count");
  badge.hidden = waiting === 0;
  badge.textContent = String(waiting);
  document.title = waiting ? `(${waiting}) hostcall console` : "hostcall console";

  const main = document.getElementById("view");
  if (operatorBusy()) { deferred = true; return; }
  deferred = false;
  const content = [];
  if (state.error) content.push(el("p", { class: "error" }, `Could not read the supervisor: ${state.error}`));
  if (view === "approvals") content.push(approvalsView());
  else if (view === "invocation") content.push(invocationView(id));
  else if (view === "receipts") content.push(receiptsView());
  else if (view === "metrics") content.push(metricsView());
  else content.push(invocationsView());
  main.replaceChildren(...content);
  tickLeases();
}

function outcomeChips(counts) {
  const entries = Object.entries(counts || {}).filter(([, n]) => n);
  if (!entries.length) return [el("span", { class: "muted" }, "none")];
  return entries.map(([outcome, n]) => chip(`${outcome} ${n}`, `o-${outcome}`));
}

function budgetText(budget) {
  if (!budget) return "—";
  const parts = [];
  if (budget.max_calls !== null) parts.push(`${budget.calls_left}/${budget.max_calls} calls`);
  if (budget.max_cost !== null) parts.push(`${budget.cost_left}/${budget.max_cost} cost`);
  return parts.length ? parts.join(", ") : "unlimited";
}

function sandboxText(sandbox) {
  if (!sandbox || sandbox === "off") return "off";
  if (sandbox.runtime) {
    // A WebAssembly guest (docs/wasm.md): its runtime is its sandbox.
    return `WebAssembly ${sandbox.kind || "module"}, ${sandbox.runtime} ${sandbox.version || ""}`;
  }
  return `${sandbox.namespaces || "?"}; limits ${sandbox.limits || "?"}`;
}

function limitsText(limits) {
  if (!limits) return "—";
  const parts = [];
  if (limits.timeout_s) parts.push(`timeout ${limits.timeout_s} s`);
  if (limits.memory_bytes) parts.push(`memory ${Math.round(limits.memory_bytes / 1048576)} MiB`);
  if (limits.cpu_s) parts.push(`cpu ${limits.cpu_s} s`);
  if (limits.max_processes) parts.push(`${limits.max_processes} tasks`);
  if (limits.max_open_files) parts.push(`${limits.max_open_files} files`);
  return parts.length ? parts.join(", ") : "none";
}

function executionState(execution) {
  const outcome = execution.outcome;
  const text = outcome ? `${execution.state}: ${outcome.reason}, exit ${outcome.exit_status}` : execution.state;
  return chip(text, `s-${execution.state}`);
}

function invocationsView() {
  const invocations = state.overview?.invocations || [];
  const rows = [...invocations].sort((a, b) => (a.created_at < b.created_at ? 1 : -1)).map((inv) => {
    const last = inv.executions[inv.executions.length - 1];
    return el("tr", { "data-invocation": inv.invocation_id },
      el("td", { class: "mono" }, el("a", { href: `#invocation/${encodeURIComponent(inv.invocation_id)}` }, inv.invocation_id)),
      el("td", {}, inv.plan_name || short(inv.plan_hash, 20)),
      el("td", {}, chip(inv.state, `s-${inv.state}`)),
      el("td", {}, inv.executions.length ? [String(inv.executions.length), " ", last ? executionState(last) : null] : el("span", { class: "muted" }, "none here")),
      el("td", {}, last ? sandboxText(last.sandbox) : "—", el("div", { class: "muted" }, last ? limitsText(last.limits) : "")),
      el("td", {}, outcomeChips(inv.calls_by_outcome)),
      el("td", {}, budgetText(inv.budget)),
      el("td", { class: "mono muted" }, inv.created_at));
  });
  return el("section", {},
    el("h2", {}, `Invocations (${invocations.length})`),
    rows.length
      ? el("table", {}, el("thead", {}, el("tr", {}, ["Invocation", "Plan", "State", "Executions", "Sandbox and limits", "Calls by outcome", "Budget left", "Created"].map((h) => el("th", {}, h)))), el("tbody", {}, rows))
      : el("p", { class: "empty" }, "No invocation yet."));
}

function invocationView(id) {
  const data = state.invocation;
  if (!data || data.invocation?.invocation_id !== id) return el("p", { class: "empty" }, `Loading ${id}…`);
  const inv = data.invocation;
  const executions = inv.executions.map((e) => el("tr", {},
    el("td", { class: "mono" }, e.execution_id),
    el("td", {}, executionState(e)),
    el("td", { class: "mono" }, short((e.argv || []).join(" "), 120)),
    el("td", {}, sandboxText(e.sandbox)),
    el("td", {}, limitsText(e.limits)),
    el("td", {}, outcomeChips(e.calls))));
  const calls = data.calls.map((c) => el("tr", { "data-call": c.call_id },
    el("td", { class: "mono muted" }, (c.finished_at || "").replace("T", " ").replace(/\.\d+Z$/, "Z")),
    el("td", { class: "mono" }, c.call_id),
    el("td", {}, inert(c.tool)),
    el("td", {}, c.args_kept ? el("pre", { class: "args" }, pretty(c.args)) : el("span", { class: "muted" }, data.calls_source === "receipts" ? "not kept (from receipts)" : "not kept")),
    el("td", {}, chip(c.outcome, `o-${c.outcome}`), c.code ? el("div", { class: "muted" }, c.code) : null),
    el("td", {}, c.effect),
    el("td", { class: "mono", title: c.idempotency_key || "" }, short(c.idempotency_key || "—", 14)),
    el("td", { class: "mono" }, c.receipt_id || "—"),
    el("td", { class: "mono" }, c.duration_ms === null ? "—" : `${c.duration_ms} ms`)));
  const logs = data.logs.length
    ? data.logs.map((l) => el("div", {}, el("h3", {}, `${l.execution_id} ${l.stream}`), el("pre", { class: "log" }, l.text || "(empty)")))
    : [el("p", { class: "muted" }, "No output.")];
  return el("section", {},
    el("h2", {}, "Invocation ", el("span", { class: "mono" }, inv.invocation_id)),
    el("div", { class: "panel" },
      el("div", {}, "Plan ", el("b", {}, inv.plan_name || "?"), " ", el("span", { class: "mono muted" }, inv.plan_hash)),
      el("div", {}, "State ", chip(inv.state, `s-${inv.state}`), " · Budget left: ", budgetText(inv.budget), " · Calls: ", outcomeChips(inv.calls_by_outcome))),
    el("h3", {}, "Executions"),
    executions.length
      ? el("table", {}, el("thead", {}, el("tr", {}, ["Execution", "State", "Command", "Sandbox", "Limits", "Calls"].map((h) => el("th", {}, h)))), el("tbody", {}, executions))
      : el("p", { class: "muted" }, "None in this supervisor."),
    el("h3", {}, `Calls (${data.calls.length})`),
    calls.length
      ? el("table", { id: "calls" }, el("thead", {}, el("tr", {}, ["Finished", "Call", "Tool", "Arguments", "Outcome", "Effect", "Idempotency key", "Receipt", "Took"].map((h) => el("th", {}, h)))), el("tbody", {}, calls))
      : el("p", { class: "muted" }, "No calls yet."),
    el("h3", {}, "Logs (tail)"),
    logs);
}

function approvalsView() {
  const proposals = [...(state.overview?.approvals || [])];
  const invocations = Object.fromEntries((state.overview?.invocations || []).map((i) => [i.invocation_id, i]));
  proposals.sort((a, b) => {
    if ((a.state === "waiting") !== (b.state === "waiting")) return a.state === "waiting" ? -1 : 1;
    return a.state === "waiting" ? (a.created_at < b.created_at ? -1 : 1) : (a.created_at < b.created_at ? 1 : -1);
  });
  const listed = new Set(proposals.map((p) => p.id));
  for (const id of Object.keys(wholeArgs)) if (!listed.has(id)) delete wholeArgs[id];
  const cards = proposals.map((p) => proposalCard(p, invocations[p.invocation_id]));
  return el("section", {},
    el("h2", {}, "Approvals"),
    cards.length ? cards : el("p", { class: "empty" }, "No proposal yet: calls that need approval show up here."));
}

function proposalCard(p, invocation) {
  const execution = invocation?.executions.find((e) => e.execution_id === p.execution_id);
  const facts = el("dl", {},
    el("dt", {}, "Tool"), el("dd", {}, el("b", {}, p.tool), " ", chip(p.reversibility || "irreversible", `rev-${p.reversibility || "irreversible"}`)),
    el("dt", {}, "State"), el("dd", { class: "proposal-state" }, chip(p.state, `s-${p.state}`)),
    el("dt", {}, "Invocation"), el("dd", { class: "mono" }, el("a", { href: `#invocation/${encodeURIComponent(p.invocation_id)}` }, p.invocation_id)),
    el("dt", {}, "Execution"), el("dd", { class: "mono" }, p.execution_id),
    execution ? [el("dt", {}, "Command"), el("dd", { class: "mono" }, short((execution.argv || []).join(" "), 160))] : null,
    el("dt", {}, "Call"), el("dd", { class: "mono" }, p.call_id),
    el("dt", {}, "Idempotency key"), el("dd", { class: "mono" }, p.idempotency_key),
    el("dt", {}, "Asked"), el("dd", { class: "mono" }, p.created_at),
    el("dt", {}, p.state === "waiting" ? "Lease" : "Lease ended"),
    el("dd", {}, p.state === "waiting"
      ? el("span", { class: "lease", "data-expires": p.expires_at }, leftText(Date.parse(p.expires_at) - serverNow()))
      : el("span", { class: "mono" }, p.expires_at)),
    p.state !== "waiting" && p.decided_at ? [el("dt", {}, "Decided"), el("dd", {}, `${p.decided_at} by ${p.decided_by || "?"}`)] : null,
    p.reason ? [el("dt", {}, "Reason"), el("dd", { class: "reason-text" }, p.reason)] : null);
  const actions = [];
  if (p.state === "waiting") {
    const reason = el("input", { class: "reason", placeholder: "reason (for Reject)", maxlength: 2000, "aria-label": "reason" });
    const decide = (decision) => async (event) => {
      for (const button of event.target.parentElement.querySelectorAll("button")) button.disabled = true;
      try {
        const body = decision === "reject" ? { reason: reason.value } : {};
        const decided = await api(`/api/approvals/${encodeURIComponent(p.id)}/${decision}`, { method: "POST", body: JSON.stringify(body) });
        notes[p.id] = `${decided.state}`;
      } catch (error) {
        notes[p.id] = `could not ${decision}: ${error.message}`;
      }
      reason.blur();
      want("overview");
    };
    // An operator approves what they have seen whole (SPEC §14): a call
    // whose arguments were listed as a preview is approved once they are loaded.
    const unseen = previewed(p) && !(p.id in wholeArgs);
    actions.push(el("div", { class: "actions" },
      el("button", { class: "approve", onclick: decide("approve"), disabled: unseen, title: unseen ? (notes[p.id] ? "the full arguments did not load: Show all tries again" : "loading the full arguments") : null }, "Approve"),
      reason,
      el("button", { class: "reject", onclick: decide("reject") }, "Reject")));
  }
  if (notes[p.id]) actions.push(el("p", { class: "muted note" }, notes[p.id]));
  return el("article", { class: "panel proposal", "data-proposal": p.id, "data-state": p.state },
    el("div", {}, facts, actions),
    el("div", {}, el("div", { class: "muted" }, "Arguments"), argsView(p)));
}

// The overview lists arguments over 16 KiB as the start of their JSON text
// (args null, args_preview): a guest's megabyte calls cannot make the list too
// long to load. The whole comes from the proposal itself: a waiting call's at
// once (it is decided on them), an ended one's on a click.
function previewed(p) { return p.args === null && typeof p.args_preview === "string"; }
const loadingArgs = new Set();
async function loadWholeArgs(id) {
  if (loadingArgs.has(id)) return;
  loadingArgs.add(id);
  try {
    wholeArgs[id] = pretty((await api(`/api/approvals/${encodeURIComponent(id)}`)).args);  // once
  } catch (error) {
    notes[id] = `could not load the arguments: ${error.message}`;
  } finally {
    loadingArgs.delete(id);
  }
  render();
}
function argsView(p) {
  if (!previewed(p)) return el("pre", { class: "args" }, pretty(p.args));
  if (p.id in wholeArgs) return el("pre", { class: "args" }, wholeArgs[p.id]);
  if (p.state === "waiting" && !notes[p.id]) loadWholeArgs(p.id);
  const showAll = (event) => { event.target.disabled = true; delete notes[p.id]; loadWholeArgs(p.id); };
  return [
    el("pre", { class: "args preview" }, `${visible(p.args_preview)}\n…`),
    el("button", { class: "whole-args", onclick: showAll }, `Show all ${p.args_bytes} bytes`),
  ];
}

function tickLeases() {
  for (const node of document.querySelectorAll("[data-expires]")) {
    const left = Date.parse(node.dataset.expires) - serverNow();
    node.textContent = leftText(left);
    node.classList.toggle("low", left < 30000);
  }
}

function receiptsView() {
  const data = state.receipts;
  if (!data) return el("p", { class: "empty" }, "Verifying…");
  const link = (r) => el("td", { class: "mono" }, el("a", { href: `#invocation/${encodeURIComponent(r.invocation_id)}` }, r.invocation_id));
  const rows = data.reports.map((r) => r.error ? el("tr", { "data-invocation": r.invocation_id },
    link(r),
    el("td", {}, "—"),
    el("td", { colspan: 3 }, chip(r.error.status === 503 ? "still verifying" : "not verified", r.error.status === 503 ? "" : "bad"), " ", el("span", { class: "muted" }, inert(r.error.message)))) : el("tr", { "data-invocation": r.invocation_id },
    link(r),
    el("td", {}, String(r.receipts)),
    el("td", {}, r.exists ? chip(r.chain_intact ? "intact" : "broken", r.chain_intact ? "ok" : "bad") : el("span", { class: "muted" }, "no file yet")),
    el("td", {}, r.checked_against ? chip(r.ok ? "agree" : "disagree", r.ok ? "ok" : "bad") : el("span", { class: "muted" }, "chain only")),
    el("td", {}, r.findings.length ? el("ul", {}, r.findings.map((f) => el("li", { class: f.severity === "error" ? "error" : "muted" }, inert(f.line ? `line ${f.line}: ${f.message}` : f.message)))) : el("span", { class: "muted" }, "none"))));
  return el("section", {},
    el("h2", {}, "Receipts"),
    el("p", { class: "muted" }, `Each invocation's receipt chain, verified as hostcall receipts verify does (${data.shown} of ${data.of} invocations, newest first).`),
    rows.length ? el("table", {}, el("thead", {}, el("tr", {}, ["Invocation", "Receipts", "Hash chain", "Against the effect records", "Findings"].map((h) => el("th", {}, h)))), el("tbody", {}, rows)) : el("p", { class: "empty" }, "No invocation yet."));
}

function metricsView() {
  const data = state.metrics;
  const stats = state.overview?.stats;
  const head = el("p", {}, "In flight now: ", el("b", {}, String(stats?.in_flight ?? "—")),
    " · Proposals waiting: ", el("b", {}, String(stats?.proposals_waiting ?? "—")));
  if (!data || data.samples.length < 2) return el("section", {}, el("h2", {}, "Metrics"), head, el("p", { class: "empty" }, "Collecting samples…"));
  const samples = data.samples;
  const series = {};
  for (const outcome of OUTCOMES) series[outcome] = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = Math.max(0.001, samples[i].t - samples[i - 1].t);
    for (const outcome of OUTCOMES) {
      const now = samples[i].calls_by_outcome[outcome] || 0;
      const before = samples[i - 1].calls_by_outcome[outcome] || 0;
      series[outcome].push([samples[i].t, Math.max(0, (now - before) / dt)]);
    }
  }
  const t0 = samples[1].t, t1 = samples[samples.length - 1].t;
  const peak = Math.max(1, ...OUTCOMES.flatMap((o) => series[o].map((p) => p[1])));
  const W = 900, H = 240, L = 50, B = 24;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "chart");
  const line = (x1, y1, x2, y2, colour) => {
    const node = document.createElementNS(svg.namespaceURI, "line");
    for (const [k, v] of Object.entries({ x1, y1, x2, y2, stroke: colour })) node.setAttribute(k, v);
    svg.append(node);
  };
  const text = (x, y, content) => {
    const node = document.createElementNS(svg.namespaceURI, "text");
    node.setAttribute("x", x); node.setAttribute("y", y); node.setAttribute("font-size", "11"); node.setAttribute("fill", "#667085");
    node.textContent = content;
    svg.append(node);
  };
  const x = (t) => L + ((t - t0) / Math.max(1, t1 - t0)) * (W - L - 10);
  const y = (v) => H - B - (v / peak) * (H - B - 10);
  line(L, y(0), W - 10, y(0), "#e3e6eb");
  line(L, y(peak), W - 10, y(peak), "#e3e6eb");
  text(4, y(peak) + 4, `${peak.toFixed(peak < 10 ? 1 : 0)}/s`);
  text(4, y(0) + 4, "0");
  text(L, H - 6, `${Math.round((t1 - t0) / 60 * 10) / 10} min ago`);
  text(W - 40, H - 6, "now");
  for (const outcome of OUTCOMES) {
    if (!series[outcome].some((p) => p[1] > 0)) continue;
    const path = document.createElementNS(svg.namespaceURI, "polyline");
    path.setAttribute("points", series[outcome].map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "));
    path.setAttribute("fill", "none");
    path.setAttribute("stroke", COLOURS[outcome]);
    path.setAttribute("stroke-width", "2");
    path.setAttribute("data-outcome", outcome);
    svg.append(path);
  }
  const last = samples[samples.length - 1].calls_by_outcome;
  const legend = el("div", { class: "legend" }, OUTCOMES.map((o) => el("span", {}, el("i", { style: null, "data-colour": o }), `${o}: ${last[o] || 0} in all, ${(series[o].at(-1)?.[1] || 0).toFixed(1)}/s now`)));
  for (const swatch of legend.querySelectorAll("i")) swatch.style.background = COLOURS[swatch.dataset.colour];
  return el("section", {}, el("h2", {}, "Metrics"), head,
    el("p", { class: "muted" }, `Calls per second by outcome, sampled every ${data.interval_s} s.`), svg, legend);
}

window.addEventListener("hashchange", () => { render(); want("invocation", "receipts", "metrics"); });
window.addEventListener("DOMContentLoaded", () => {
  render();
  connect();
  setInterval(tickLeases, 1000);
});
