// kmqd dashboard: draws the page the path names from the JSON API (docs/DASHBOARD.md), asking again every
// second (a task's page asks once, and again on its button: a lookup scans the queue's lists). Everything shown is
// put in with textContent, never as HTML: task data and error messages are whatever producers and handlers wrote.
"use strict";

const CSRF = document.querySelector('meta[name="kmqd-csrf"]').content;
const READ_ONLY = document.querySelector('meta[name="kmqd-read-only"]').content === "true";
// How often a page asks again: the overview reads the dashboard's last poll (no Redis call), so twice per poll
// of Redis (once a second), and a change shows within 1.5 s; the other pages ask Redis, once a second.
const POLL_MS = 1000;
const OVERVIEW_POLL_MS = 500;

// el("td", {class: "num"}, "12", otherNode): an element with attributes and children (strings become text).
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(columns, rows, empty) {
  if (!rows.length) return el("div", { class: "scroll" }, el("div", { class: "empty" }, empty));
  const head = el("tr", {}, columns.map(([title, cls]) => el("th", { class: cls }, title)));
  return el("div", { class: "scroll" }, el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

// 1234 -> "1.2s", 95000 -> "1m 35s", 7300000 -> "2h 1m".
function duration(ms) {
  if (ms === null || ms === undefined) return "-";
  const sign = ms < 0 ? "-" : "";
  ms = Math.abs(ms);
  if (ms < 1000) return sign + ms + "ms";
  if (ms < 60000) return sign + (ms / 1000).toFixed(1) + "s";
  const s = Math.floor(ms / 1000);
  if (s < 3600) return sign + Math.floor(s / 60) + "m " + (s % 60) + "s";
  return sign + Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}

function clock(ms) {
  return ms ? new Date(ms).toLocaleString() : "-";
}

// 97 -> "97 B", 16777216 -> "16.0 MiB"; "(cut)" when the page was sent only the first 4 KiB of it.
function size(bytes, cut) {
  if (bytes === null || bytes === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB"];
  let value = bytes, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit++; }
  return (unit ? value.toFixed(1) : String(value)) + " " + units[unit] + (cut ? " (cut)" : "");
}

function rate(value) {
  return value === undefined || value === null ? "-" : value.toFixed(1);
}

function status(text, bad) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.className = bad ? "status bad" : "status";
}

function flash(text, bad) {
  const node = document.getElementById("flash");
  node.textContent = text;
  node.className = bad ? "bad" : "";
  node.hidden = false;
}

async function getJson(url) {
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// An action: a POST with the CSRF token; the answer is shown, the page redrawn at once.
async function act(url, body, label) {
  try {
    const response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-Kmqd-Csrf": CSRF },
      body: JSON.stringify(body || {}),
    });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error || response.statusText);
    flash(label + ": " + JSON.stringify(answer));
  } catch (error) {
    flash(label + " failed: " + error.message, true);
  }
  refresh(true);
}

function button(label, onclick, danger) {
  if (READ_ONLY) return null;
  return el("button", { class: danger ? "danger" : null, "data-action": label.toLowerCase(), onclick }, label);
}

// --- charts: hand-drawn SVG, the last hour of /api/history ------------------------------------------------

const SVG_NS = "http://www.w3.org/2000/svg";
const HISTORY_POLL_MS = 5000;
let history = null;

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

function number(value) {
  if (value === null || value === undefined) return "-";
  return value >= 100 || Number.isInteger(value) ? String(Math.round(value)) : value.toFixed(1);
}

// One chart: `series` are [field, class, label]; x is the last `minutes` minutes, y from 0 to the largest value.
function chart(title, points, series, minutes) {
  const W = 300, H = 70, span = minutes * 60000;
  const shown = points.filter((p) => p.ago_ms <= span);
  const values = series.flatMap(([field]) => shown.map((p) => p[field] ?? 0));
  const max = Math.max(...values, 0);
  const x = (ago) => (W * (1 - ago / span)).toFixed(1);
  const y = (v) => (H - 3 - (H - 6) * (max > 0 ? v / max : 0)).toFixed(1);
  const lines = series.map(([field, cls]) => {
    const xy = shown.filter((p) => p[field] !== null && p[field] !== undefined).map((p) => x(p.ago_ms) + "," + y(p[field]));
    return xy.length > 1 ? svg("polyline", { class: cls, points: xy.join(" ") })
      : svg("circle", { class: cls, cx: xy.length ? xy[0].split(",")[0] : W, cy: xy.length ? xy[0].split(",")[1] : H - 3, r: 2 });
  });
  const last = shown[shown.length - 1] || {};
  return el("div", { class: "chart" },
    el("div", { class: "chart-head" }, el("span", { class: "label" }, title), el("span", { class: "dim" }, "max " + number(max))),
    svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": title },
      svg("line", { class: "axis", x1: 0, y1: H - 3, x2: W, y2: H - 3 }), ...lines),
    el("div", { class: "legend" }, series.map(([field, cls, label]) =>
      el("span", { class: "key " + cls }, label + " " + number(last[field])))));
}

function charts(queue) {
  if (!history || !history.queues[queue]) return el("p", { class: "empty" }, "no history yet");
  const points = history.queues[queue];
  return el("div", { class: "charts", "data-queue": queue },
    chart("rate /s", points, [["done", "s-done", "done"], ["failed", "s-failed", "failed"]], history.minutes),
    chart("depth", points, [["ready", "s-ready", "ready"], ["delayed", "s-delayed", "delayed"], ["dead", "s-dead", "dead"]],
      history.minutes));
}

async function refreshHistory() {
  try {
    history = await getJson("/api/history");
    refresh(true);
  } catch (_) {
    // The status line shows Redis's trouble already; the charts keep their last points.
  }
  setTimeout(refreshHistory, HISTORY_POLL_MS);
}

function queueUrl(name) {
  return "/api/queues/" + encodeURIComponent(name);
}

// --- the pages ---------------------------------------------------------------------------------------------

const pages = {
  overview: {
    every: OVERVIEW_POLL_MS,
    url: () => "/api/overview",
    draw(data) {
      if (data.error) status("Redis: " + data.error + " (retrying; the numbers are the last good poll's)", true);
      else status("updated " + (data.updated_ms ? new Date(data.updated_ms).toLocaleTimeString() : "-"));
      const rows = data.queues.map((q) => el("tr", { "data-queue": q.name },
        el("td", {}, el("a", { href: "/queues/" + encodeURIComponent(q.name) }, q.name)),
        el("td", { class: "hide-narrow" }, q.mode),
        el("td", {}, el("span", { class: "badge " + (q.paused || q.throttled ? "paused" : "serving") }, q.paused ? "paused" : q.throttled ? "throttled" : "serving")),
        limitsCell(q.limits),
        el("td", { class: "num", "data-field": "ready",
          title: q.ready_by_level.map(([level, n]) => level + " " + n).join(", ") }, q.ready),
        el("td", { class: "hide-narrow dim wrap" }, q.ready_by_level.length > 1
          ? q.ready_by_level.map(([level, n]) => level + " " + n).join(" · ") : ""),
        el("td", { class: "num", "data-field": "processing" }, q.processing),
        el("td", { class: "num", "data-field": "delayed" }, q.delayed),
        el("td", { class: "num", "data-field": "waiting", title: "tasks of flows waiting for their dependencies" }, q.waiting),
        el("td", { class: "num" + (q.dead ? " bad" : ""), "data-field": "dead" }, q.dead),
        el("td", { class: "num", "data-field": "done_rate" }, rate(q.rates && q.rates.done)),
        el("td", { class: "num" + (q.rates && q.rates.failed > 0 ? " bad" : ""), "data-field": "failed_rate" },
          rate(q.rates && q.rates.failed)),
        el("td", { class: "num" }, duration(q.lag_ms)),
        el("td", { class: "num", "data-field": "daemons" }, q.daemons)));
      return [el("h1", {}, "Queues"), table([["queue"], ["mode", "hide-narrow"], ["state"], ["limits"], ["ready", "num"],
        ["by level", "hide-narrow"], ["processing", "num"], ["delayed", "num"], ["waiting", "num"], ["dead", "num"],
        ["done/s", "num"], ["failed/s", "num"], ["lag", "num"], ["daemons", "num"]], rows,
        "no queues in the config"),
        el("h2", {}, "The last hour"),
        el("div", { class: "chart-grid" }, data.queues.map((q) => el("div", { class: "card" },
          el("a", { href: "/queues/" + encodeURIComponent(q.name) }, q.name), charts(q.name))))];
    },
  },

  queue: {
    name: () => decodeURIComponent(location.pathname.split("/")[2] || ""),
    url() { return queueUrl(this.name()) + "?limit=20"; },
    draw(data) {
      status("updated " + new Date().toLocaleTimeString());
      const name = data.queue, s = data.stats, base = queueUrl(name);
      const cancel = (task) => task.id === null ? null
        : button("Cancel", () => act(base + "/tasks/" + encodeURIComponent(task.id) + "/cancel", {}, "cancel " + task.id), true);
      const card = (label, value, field) => el("div", { class: "card" },
        el("div", { class: "label" }, label), el("div", { class: "value", "data-field": field }, value));
      const ready = data.ready.flatMap((head) => head.tasks.map((task, position) =>
        el("tr", { "data-id": task.id },
          el("td", {}, head.level), el("td", { class: "num" }, position), taskLink(name, task.id),
          el("td", {}, task.type || "-"), el("td", { class: "num" }, task.attempt ?? "-"),
          el("td", { class: "num" }, task.created_at ? duration(data.now_ms - task.created_at) : "-"),
          sizeCell(task.envelope_bytes, task.envelope_truncated), el("td", {}, cancel(task)))));
      const delayed = data.delayed.map((d) => el("tr", { "data-id": d.task.id },
        taskLink(name, d.task.id), el("td", {}, d.task.type || "-"), el("td", {}, d.level),
        el("td", {}, clock(d.due_at_ms)), el("td", { class: "num" }, duration(d.due_in_ms)),
        sizeCell(d.task.envelope_bytes, d.task.envelope_truncated), el("td", {}, cancel(d.task))));
      const retrying = data.retrying.map((d) => el("tr", { "data-id": d.task.id },
        taskLink(name, d.task.id), el("td", {}, d.task.type || "-"), el("td", { class: "num" }, d.task.attempt ?? "-"),
        el("td", { class: "wrap bad" }, d.task.last_error || ""), el("td", { class: "num" }, duration(d.due_in_ms)),
        sizeCell(d.task.envelope_bytes, d.task.envelope_truncated), el("td", {}, cancel(d.task))));
      const dead = data.dead.map((r) => el("tr", { "data-id": r.id },
        taskLink(name, r.id), el("td", {}, r.type || "-"), el("td", { class: "num" }, r.attempt ?? "-"),
        el("td", { class: "wrap bad" }, r.reason || ""),
        el("td", { class: "num" }, r.dead_at ? duration(data.now_ms - r.dead_at) + " ago" : "-"),
        sizeCell(r.record_bytes, r.truncated),
        el("td", {}, el("div", { class: "actions" },
          button("Requeue", () => act(base + "/dead/requeue", { ids: [r.id] }, "requeue " + r.id)),
          button("Purge", () => confirm("Purge the dead record of " + r.id + "?")
            && act(base + "/dead/purge", { ids: [r.id] }, "purge " + r.id), true)))));
      const daemons = data.daemons.map(daemonRow);
      return [
        el("h1", {}, name, el("span", { class: "dim" }, data.mode || ""),
          el("span", { class: "badge " + (s.paused || s.throttle_ms != null ? "paused" : "serving"), id: "queue-state" },
            s.paused ? "paused" : s.throttle_ms != null ? "throttled" : "serving"),
          data.limits && data.limits.held_back.length ? el("span", { class: "badge paused", id: "held-badge",
            title: data.limits.held_back.join(" · ") }, "held back") : null,
          s.paused ? button("Resume", () => act(base + "/resume", {}, "resume " + name))
            : button("Pause", () => act(base + "/pause", {}, "pause " + name))),
        el("div", { class: "cards" },
          card("ready", s.ready, "ready"), card("processing", s.processing, "processing"),
          card("delayed", s.delayed - s.retrying, "delayed"), card("retrying", s.retrying, "retrying"),
          card("waiting", s.waiting, "waiting"),
          card("dead", s.dead, "dead"), card("done", s.done, "done"), card("failed", s.failed, "failed"),
          card("lag", duration(s.lag_ms), "lag")),
        el("div", { class: "card history" }, charts(name)),
        ...limitsPanel(data.limits),
        ...groupsPanel(data.groups, base),
        el("h2", {}, "Ready (the next to run, per level)"),
        el("p", { class: "dim", id: "cut-note" }, "These lists are sent each task's envelope, error or dead record cut to",
          " 4 KiB, and stop at about 4 MiB of a list's tasks (fewer than asked when they are large): a task's own",
          " page shows it whole."),
        el("div", { id: "ready" }, table([["level"], ["#", "num"], ["id"], ["type"], ["attempt", "num"], ["age", "num"],
          ["size", "num"], [""]], ready, "nothing ready")),
        el("h2", {}, "Delayed"),
        el("div", { id: "delayed" }, table([["id"], ["type"], ["level"], ["due"], ["in", "num"], ["size", "num"], [""]],
          delayed, "nothing delayed")),
        el("h2", {}, "Retrying"),
        el("div", { id: "retrying" }, table([["id"], ["type"], ["attempt", "num"], ["last error"], ["in", "num"],
          ["size", "num"], [""]], retrying, "nothing waiting to retry")),
        el("h2", {}, "Dead ", s.dead ? el("span", { class: "actions" },
          button("Requeue all", () => confirm("Requeue all " + s.dead + " dead tasks of " + name + "?")
            && act(base + "/dead/requeue", { all: true }, "requeue all")),
          button("Purge all", () => confirm("Purge all " + s.dead + " dead records of " + name + "?")
            && act(base + "/dead/purge", { all: true }, "purge all"), true)) : null),
        el("div", { id: "dead" }, table([["id"], ["type"], ["attempt", "num"], ["reason"], ["dead", "num"], ["size", "num"],
          [""]], dead, "no dead tasks")),
        el("h2", {}, "Daemons"),
        daemonTable(daemons),
      ];
    },
  },

  daemons: {
    url: () => "/api/daemons",
    draw(data) {
      status("updated " + new Date().toLocaleTimeString());
      return [el("h1", {}, "Daemons"), daemonTable(data.daemons.map(daemonRow))];
    },
  },

  task: {
    // Asked once when the page opens, and again on "Look again": a lookup scans the queue's lists (up to the
    // dashboard's limit), which is no work to repeat every second (docs/DASHBOARD.md, "Pages").
    every: 0,
    params: () => new URLSearchParams(location.search),
    url() {
      const p = this.params();
      const offset = p.get("offset") ? "?offset=" + encodeURIComponent(p.get("offset")) : "";
      return p.get("queue") && p.get("id")
        ? queueUrl(p.get("queue")) + "/tasks/" + encodeURIComponent(p.get("id")) + offset : null;
    },
    draw(data) {
      const p = this.params();
      const form = el("form", { class: "find", method: "get", action: "/task" },
        el("input", { name: "queue", placeholder: "queue", value: p.get("queue") || "", required: true }),
        el("input", { name: "id", placeholder: "task id", value: p.get("id") || "", required: true, size: 36 }),
        el("button", { type: "submit" }, "Find"));
      if (!data) { status(""); return [el("h1", {}, "Find a task"), form]; }
      status("looked at " + new Date().toLocaleTimeString() + ", " + data.searched + " tasks searched");
      const again = el("button", { type: "button", "data-action": "look-again", onclick: () => refresh(true) }, "Look again");
      const partial = data.complete ? null : el("p", { class: "bad", id: "partial" },
        "Not searched to the end: the dashboard stops after " + data.searched + " tasks of the queue's lists. ",
        "kmqd task show " + data.queue + " " + data.id + " searches them all.");
      const places = data.found.map((f) => el("div", { class: "found" },
        el("h2", {}, f.state, f.level ? " · level " + f.level : "", f.due_in_ms !== undefined ? " · due in " + duration(f.due_in_ms) : "",
          f.position !== undefined ? " · " + f.position + " ahead of it" : "", f.owner ? " · owner " + f.owner : ""),
        progressOf(f.progress), el("pre", {}, pretty(f.envelope || f.record))));
      return [el("h1", {}, "Find a task"), form, el("div", { class: "actions" }, again), partial,
        ...(places.length ? places : [el("p", { class: "empty" }, data.flow && data.flow.state === "waiting"
          ? "in none of " + data.queue + "'s lists: it waits for its dependencies (its flow, below)"
          : data.result ? "in none of " + data.queue + "'s lists: it ended (its result, below)"
          : "not in " + data.queue + ": unknown, done, or trimmed")]),
        ...resultAndFlow(data)];
    },
  },
};

// --- a task's result and flow: its kept result, and the tree of the tasks it waits for ----------------------

// The task page's sections for its kept result and its flow (docs/DASHBOARD.md, "Results and flows"). Results
// are user data: shown as text, as everything else.
function resultAndFlow(data) {
  const sections = [];
  if (data.result) {
    const r = data.result;
    sections.push(el("h2", {}, "Result"), el("div", { id: "result", "data-state": r.state },
      el("p", {}, el("span", { class: "badge state-" + r.state }, r.state), " ended " + clock(r.ended_at),
        r.result_error ? el("span", { class: "bad" }, " · not kept: " + r.result_error) : null),
      el("pre", { class: r.state === "dead" ? "bad" : null }, r.state === "dead" ? r.reason : JSON.stringify(r.result, null, 2))));
  }
  if (data.flow) {
    const f = data.flow;
    const more = f.more ? el("p", { id: "flow-more" }, el("a", { href: "/task?queue=" + encodeURIComponent(data.queue)
      + "&id=" + encodeURIComponent(data.id) + "&offset=" + (f.offset + f.after.length) },
      "next " + Math.min(f.more, 20) + " of the " + f.more + " more it waits for")) : null;
    const earlier = f.offset ? el("p", {}, el("a", { href: "/task?queue=" + encodeURIComponent(data.queue)
      + "&id=" + encodeURIComponent(data.id) }, "back to its first dependencies")) : null;
    sections.push(el("h2", {}, "Flow"),
      el("p", { class: "dim" }, "The tasks it waits for, and theirs, each with its state; a task's own page shows more of",
        " its dependencies. running: a daemon holds it now; released: its dependencies ended, it waits in its ready list;",
        " pending: waits for nothing and has not ended (delayed or ready: its page says where)."),
      earlier, el("div", { id: "flow", class: "flow" }, el("ul", {}, flowNode(f))), more);
  }
  return sections;
}

// One task of the flow's tree and, nested, the page of its dependencies shown.
function flowNode(node) {
  const link = el("a", { href: "/task?queue=" + encodeURIComponent(node.queue) + "&id=" + encodeURIComponent(node.id),
    "data-link": "node" }, node.queue + " / " + node.id);
  const f = node.flow;
  const counts = f ? el("span", { class: "dim small", "data-field": "counts" }, " waits for " + f.dependencies + ": "
    + f.done + " done, " + f.dead + " dead, " + (f.dependencies - f.done - f.dead) + " not ended") : null;
  const result = node.result !== undefined && node.result !== null
    ? el("code", { class: "result", "data-field": "result" }, JSON.stringify(node.result)) : null;
  const reason = node.reason ? el("span", { class: "bad wrap", "data-field": "reason" }, node.reason) : null;
  const more = node.more ? el("li", { class: "dim", "data-field": "more" }, "… " + node.more + " more") : null;
  return el("li", { "data-queue": node.queue, "data-id": node.id, "data-state": node.state },
    link, " ", el("span", { class: "badge state-" + node.state }, node.state), " ", result, reason, counts,
    node.after.length || more ? el("ul", {}, node.after.map(flowNode), more) : null);
}

// --- limits: the queue's flow control against what Redis counts, as `kmqd stats` says it -------------------

// 1000 -> "1s", 60000 -> "1m", 3600000 -> "1h", 250 -> "250ms": a rate window's length, as the config writes it.
function windowText(ms) {
  for (const [unit, size] of [["h", 3600000], ["m", 60000], ["s", 1000]]) {
    if (ms % size === 0) return ms / size + unit;
  }
  return ms + "ms";
}

// A count against its limit as a bar (SVG, as the charts: the page's CSP allows no inline style).
function bar(used, limit, full) {
  const width = limit > 0 ? Math.min(100, (100 * used) / limit) : 0;
  return svg("svg", { class: "bar" + (full ? " full" : ""), viewBox: "0 0 100 6", preserveAspectRatio: "none",
    role: "img", "aria-label": used + " of " + limit },
  svg("rect", { class: "track", width: 100, height: 6 }), svg("rect", { class: "fill", width: width.toFixed(1), height: 6 }));
}

// The overview's compact form: running against max_running, and a "held back" badge naming what holds it.
function limitsCell(limits) {
  if (!limits) return el("td", { class: "dim", "data-field": "limits" }, "-");
  const running = limits.max_running;
  return el("td", { "data-field": "limits", title: limits.line },
    running ? running.running + "/" + running.limit + " " : "",
    limits.held_back.length ? el("span", { class: "badge paused" }, "held back")
      : running ? "" : el("span", { class: "dim" }, limits.groups ? limits.groups.waiting + " groups waiting" : "limited"));
}

function limitCard(label, field, used, limit, full, note) {
  return el("div", { class: "card limit", "data-field": field },
    el("div", { class: "label" }, label),
    el("div", { class: "value" + (full ? " bad" : "") }, used + " / " + limit), bar(used, limit, full),
    note ? el("div", { class: "dim small" }, note) : null);
}

// A scope's rate windows in a line: "3/5 per 1s, 40/1000 per 1h".
function rates(list) {
  return (list || []).map((r) => r.used + "/" + r.limit + " per " + windowText(r.window_ms)).join(", ") || "-";
}

// The queue page's panel: what holds the queue back now (the words of `kmqd stats`), its running count and rate
// windows against their limits, its throttle's time left, and the table of its limited types. A queue with none
// of them gets one line, so that its lists stay where they were.
function limitsPanel(limits) {
  if (!limits) return [el("p", { class: "dim", id: "limits" }, "Limits: none (no max_running, rate_limit or ",
    "[[queues.limits]] in the config, and no throttle)")];
  const held = limits.held_back;
  const cards = [];
  if (limits.max_running) {
    const m = limits.max_running;
    cards.push(limitCard("running", "running", m.running, m.limit, m.held_back, "tasks taken, not yet settled"));
  }
  for (const r of limits.rate_limit || []) {
    cards.push(limitCard("rate per " + windowText(r.window_ms), "rate-" + windowText(r.window_ms), r.used, r.limit,
      r.held_back, "starts in the last " + windowText(r.window_ms)));
  }
  if (limits.groups) {
    cards.push(el("div", { class: "card limit", "data-field": "groups-waiting" }, el("div", { class: "label" },
      "groups waiting"), el("div", { class: "value" }, limits.groups.waiting), el("div", { class: "dim small" },
      "groups with tasks in their own lists")));
  }
  if (limits.throttle_ms !== undefined) {
    cards.push(el("div", { class: "card limit", "data-field": "throttle" }, el("div", { class: "label" }, "throttled"),
      el("div", { class: "value bad" }, duration(limits.throttle_ms)), el("div", { class: "dim small" },
        "more: a handler asked for back-pressure")));
  }
  const types = (limits.types || []).map((t) => {
    const running = t.max_running;
    return el("tr", { "data-type": t.type },
      el("td", {}, t.type),
      el("td", { class: "num" + (running && running.held_back ? " bad" : ""), "data-field": "running" },
        running ? running.running + " / " + running.limit : "-"),
      el("td", { class: "num" + ((t.rate_limit || []).some((r) => r.held_back) ? " bad" : ""), "data-field": "rate" },
        rates(t.rate_limit)),
      el("td", { class: "num", "data-field": "waiting" }, t.waiting),
      el("td", { class: "num" + (t.throttle_ms !== undefined ? " bad" : ""), "data-field": "throttled" },
        t.throttle_ms !== undefined ? duration(t.throttle_ms) + " more" : "-"));
  });
  return [el("h2", {}, "Limits"), el("div", { id: "limits" },
    el("p", { class: held.length ? "held bad" : "held dim", "data-field": "held-back" },
      held.length ? "Held back now: " + held.join(" · ") : "Not held back now"),
    cards.length ? el("div", { class: "cards limits" }, cards) : null,
    types.length ? el("h3", {}, "Limited types") : null,
    types.length ? el("div", { id: "types" }, table([["type"], ["running", "num"], ["rate", "num"],
      ["waiting", "num"], ["throttled", "num"]], types, "")) : null)];
}

// A grouped queue's busiest groups (the answer's `groups`, null for a queue without [queues.groups]), as `kmqd
// groups` lists them, each with its Pause or Resume. The dashboard reads them at most every few seconds (they
// cost Redis a scan of every group), so the panel says how old its read is.
function groupsPanel(groups, base) {
  if (!groups) return [];
  const rows = groups.list.map((g) => {
    const name = g.name === "" ? "(no group)" : g.name;
    const label = g.name === "" ? "the tasks without a group" : "group " + g.name;
    const url = base + "/groups/" + encodeURIComponent(g.name);
    const full = groups.max_running !== null && g.running >= groups.max_running;
    const state = g.paused ? "paused" : g.throttled_ms !== null ? "throttled" : g.held_back ? "held back" : "taking turns";
    return el("tr", { "data-group": g.name },
      el("td", {}, name),
      el("td", { class: "num", "data-field": "waiting" }, g.waiting),
      el("td", { class: "num" + (full ? " bad" : ""), "data-field": "running" },
        groups.max_running !== null ? g.running + " / " + groups.max_running : g.running),
      el("td", { class: "num" + (g.throttled_ms !== null ? " bad" : ""), "data-field": "throttled" },
        g.throttled_ms !== null ? duration(g.throttled_ms) + " more" : "-"),
      el("td", { "data-field": "state" }, el("span", { class: "badge " + (state === "taking turns" ? "serving" : "paused") },
        state)),
      el("td", {}, g.paused ? button("Resume", () => act(url + "/resume", {}, "resume " + label))
        : button("Pause", () => act(url + "/pause", {}, "pause " + label))));
  });
  return [el("h2", {}, "Groups"), el("div", { id: "groups" },
    el("p", { class: "dim small", "data-field": "groups-read" }, "The busiest " + groups.limit + " groups with tasks ",
      "waiting or running, read " + duration(groups.age_ms) + " ago (at most every " + duration(groups.every_ms),
      "; kmqd groups lists more). A paused group's tasks wait; the other groups take their turns."),
    table([["group"], ["waiting", "num"], ["running", "num"], ["throttled", "num"], ["state"], [""]], rows,
      "no group has tasks waiting or running"))];
}

function sizeCell(bytes, cut) {
  return el("td", { class: "num", "data-field": "size", title: cut ? "this page was sent its first 4 KiB" : null },
    size(bytes, cut));
}

// A running task's latest progress report (docs/PROTOCOL.md, "Progress"): a bar, the percentage, the message and
// its age; nothing for a task that reported none.
function progressOf(progress) {
  if (!progress) return null;
  return el("p", { class: "progress" },
    el("progress", { max: 1, value: progress.fraction }),
    " " + Math.round(progress.fraction * 100) + "% " + progress.message + " · reported " + duration(progress.age_ms) + " ago");
}

function taskLink(queue, id) {
  if (id === null || id === undefined || id === "") return el("td", { class: "dim" }, "(no id)");
  return el("td", {}, el("a", { href: "/task?queue=" + encodeURIComponent(queue) + "&id=" + encodeURIComponent(id) }, id));
}

function daemonRow(w) {
  const state = w.draining ? "draining" : w.paused ? "paused" : "serving";
  return el("tr", { "data-owner": w.owner },
    el("td", {}, w.queue), el("td", {}, w.host), el("td", { class: "num" }, w.pid), el("td", {}, w.version),
    el("td", { class: "num" }, duration(w.lease_left_ms)), el("td", { class: "num" }, w.held ?? "-"),
    el("td", { class: "num" + (w.stuck ? " bad" : ""), "data-field": "stuck" }, w.stuck ?? "-"),
    el("td", {}, clock(w.started_at_ms)), el("td", {}, el("span", { class: "badge " + state }, state)),
    el("td", { class: "dim" }, w.owner));
}

function daemonTable(rows) {
  return el("div", { id: "daemons" }, table([["queue"], ["host"], ["pid", "num"], ["version"], ["lease left", "num"],
    ["held", "num"], ["stuck", "num"], ["started"], ["state"], ["owner"]], rows, "no daemon alive on these queues"));
}

function pretty(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch (_) { return text; }
}

// --- the loop ----------------------------------------------------------------------------------------------

function currentPage() {
  const path = location.pathname;
  if (path.startsWith("/queues/")) return pages.queue;
  if (path === "/daemons") return pages.daemons;
  if (path === "/task") return pages.task;
  return pages.overview;
}

let last = null;
let timer = null;

// Asks the page's URL and redraws when the answer changed (an unchanged page keeps its buttons under the
// pointer); `force` redraws anyway, right after an action.
async function refresh(force) {
  clearTimeout(timer);
  const page = currentPage();
  const url = page.url();
  try {
    const data = url ? await getJson(url) : null;
    const text = JSON.stringify(data);
    if (force || text !== last) {
      last = text;
      // A page's sections may be null (nothing to show): left out, not drawn as the text "null".
      document.getElementById("main").replaceChildren(...page.draw(data).filter((node) => node !== null && node !== undefined));
    }
  } catch (error) {
    status(error.message + " (retrying)", true);
  }
  if (url && page.every !== 0) timer = setTimeout(refresh, page.every || POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  if (READ_ONLY) document.getElementById("mode-badge").append(el("span", { class: "badge ro" }, "read-only"));
  const page = currentPage();
  if (page === pages.overview || page === pages.queue) refreshHistory();
  refresh(true);
});
