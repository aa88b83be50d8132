// The operator's console: a page per hash route (#/, #/nodes, #/node/MAC, #/images,
// #/rollouts), each drawn from the JSON API with the session cookie. Text from the API
// is only ever set as text (never parsed as HTML). Writes carry the CSRF token.
"use strict";

let csrf = null;
let live = null; // the node page's event stream
const PAGE = 50;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "on") for (const [ev, f] of Object.entries(v)) e.addEventListener(ev, f);
    else if (v !== null && v !== undefined && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function status(text, bad) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = bad ? "error" : "";
}

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  if (method !== "GET") headers["X-Bootfleet-CSRF"] = csrf || "";
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) { showLogin(); throw new Error("logged out"); }
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = text; }
  if (!r.ok) throw new Error((data && data.error) || `${method} ${path}: ${r.status}`);
  return { data, headers: r.headers };
}

function stateBadge(s) { return el("span", { class: `state ${s}` }, s); }
function nodeLink(mac) { return el("a", { href: `#/node/${mac}` }, mac); }

function showLogin() {
  csrf = null;
  document.getElementById("nav").hidden = true;
  document.getElementById("view").replaceChildren();
  document.getElementById("login-form").hidden = false;
}

async function login(ev) {
  ev.preventDefault();
  const input = document.getElementById("token");
  const r = await fetch("/ui/login", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token: input.value }),
  });
  input.value = "";
  if (!r.ok) {
    document.getElementById("login-error").textContent = "That token was refused.";
    return;
  }
  startSession(await r.json());
  document.getElementById("login-error").textContent = "";
  route();
}

// The session's CSRF token, and who it acts as (shown as text, never markup).
function startSession(session) {
  csrf = session.csrf;
  document.getElementById("whoami").textContent = `${session.name} (${session.role})`;
}

async function logout() {
  await fetch("/ui/logout", { method: "POST", credentials: "same-origin" });
  showLogin();
}

// --- fleet overview --------------------------------------------------------------

async function fleetView(view) {
  const f = (await api("GET", "/api/v1/fleet")).data;
  const bad = new Set(["validation-failed", "attestation-failed", "quarantined", "unreachable", "drifted", "degraded"]);
  view.append(
    el("h1", {}, `Fleet: ${f.nodes} nodes`),
    el("div", { class: "cards" }, f.by_state.map((c) =>
      el("a", { class: `card${bad.has(c.name) && c.count ? " bad" : ""}`, id: `state-${c.name}`,
                href: `#/nodes?state=${c.name}` },
        el("div", { class: "n" }, c.count), el("div", {}, c.name)))),
    el("h2", {}, "Not ready"),
    f.not_ready.length === 0 ? el("p", { id: "not-ready-none" }, "Every node is ready or waiting for an image.") :
      el("table", { id: "not-ready" },
        el("tr", {}, el("th", {}, "node"), el("th", {}, "state"), el("th", {}, "why"), el("th", {}, "since")),
        f.not_ready.map((n) => el("tr", {},
          el("td", {}, nodeLink(n.mac)), el("td", {}, stateBadge(n.state)),
          el("td", {}, n.state_reason), el("td", {}, n.updated_at)))),
    el("h2", {}, "By image"),
    el("table", { id: "by-image" }, f.by_image.map((c) =>
      el("tr", {}, el("td", {}, c.name), el("td", {}, c.count)))),
    f.by_group.length ? el("h2", {}, "By group") : null,
    f.by_group.length ? el("table", { id: "by-group" }, f.by_group.map((c) =>
      el("tr", {}, el("td", {}, el("a", { href: `#/nodes?selector=${encodeURIComponent(c.name)}` }, c.name)),
        el("td", {}, c.count)))) : null,
  );
}

// --- node list -------------------------------------------------------------------

async function nodesView(view, params) {
  const offset = Number(params.get("offset") || 0);
  const query = new URLSearchParams();
  for (const k of ["state", "selector", "q", "image"]) if (params.get(k)) query.set(k, params.get(k));
  query.set("limit", PAGE);
  query.set("offset", offset);
  const { data: nodes, headers } = await api("GET", `/api/v1/nodes?${query}`);
  const total = Number(headers.get("X-Total-Count") || nodes.length);
  const input = (id, value, placeholder) =>
    el("input", { type: "text", id, value: value || "", placeholder });
  const filters = el("form", { class: "filters", id: "node-filters" },
    input("filter-q", params.get("q"), "MAC, hostname or label"),
    input("filter-state", params.get("state"), "states: ready,unreachable"),
    input("filter-selector", params.get("selector"), "labels: rack=r1"),
    el("button", { type: "submit" }, "Filter"));
  filters.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams();
    const set = (k, id) => { const v = document.getElementById(id).value.trim(); if (v) p.set(k, v); };
    set("q", "filter-q"); set("state", "filter-state"); set("selector", "filter-selector");
    location.hash = `#/nodes?${p}`;
  });
  const page = (o) => { const p = new URLSearchParams(params); p.set("offset", o); return `#/nodes?${p}`; };
  view.append(
    el("h1", {}, "Nodes"), filters,
    el("table", { id: "nodes" },
      el("tr", {}, ["node", "hostname", "state", "assigned", "labels", "why"].map((h) => el("th", {}, h))),
      nodes.map((n) => el("tr", {},
        el("td", {}, nodeLink(n.mac)), el("td", {}, n.hostname || ""), el("td", {}, stateBadge(n.state)),
        el("td", {}, n.assigned || "-"),
        el("td", {}, Object.entries(n.labels).map(([k, v]) => `${k}=${v}`).join(" ")),
        el("td", {}, n.state_reason)))),
    el("div", { class: "pager" },
      offset > 0 ? el("a", { href: page(Math.max(0, offset - PAGE)), id: "prev" }, "previous") : null,
      el("span", { id: "node-count" }, `${total ? offset + 1 : 0}-${offset + nodes.length} of ${total}`),
      offset + nodes.length < total ? el("a", { href: page(offset + PAGE), id: "next" }, "next") : null));
}

// --- one node --------------------------------------------------------------------

function waterfall(boot) {
  const steps = boot.steps;
  const total = Math.max(1, steps.reduce((s, x) => s + Math.max(0, x.took_ms), 0));
  let start = 0;
  return el("div", { class: "waterfall" },
    el("div", {}, el("strong", {}, `boot ${boot.id}`), ` ${boot.at}, image ${boot.image.slice(0, 19)}`,
      boot.stopped_at ? el("span", { class: "error" }, ` stopped at: ${boot.stopped_at}`) : " reached ready"),
    steps.map((s) => {
      const took = Math.max(0, s.took_ms);
      const left = (100 * start) / total, width = (100 * took) / total;
      start += took;
      const bar = el("span", { class: `wf-bar${s.outcome.startsWith("ok") ? "" : " bad"}` });
      // Through the CSSOM: the page's policy refuses style attributes.
      bar.style.left = `${left}%`;
      bar.style.width = `${width}%`;
      return el("div", { class: "wf-row" },
        el("span", { class: "wf-name" }, s.step),
        el("span", { class: "wf-track" }, bar),
        el("span", {}, `${took} ms`), el("span", { class: "wf-outcome", title: s.outcome }, s.outcome));
    }),
    boot.tpm ? tpmEvidence(boot.tpm) : null);
}

// What the boot's TPM quote showed: each PCR's value, and each measured boot
// application with what it matched (or that it matched nothing this boot was given).
function tpmEvidence(tpm) {
  return el("div", { class: "tpm" },
    el("div", {}, el("strong", {}, "TPM"), ` EK ${tpm.ek_name.slice(0, 20)}…`),
    el("table", { class: "tpm-pcrs" },
      el("tr", {}, el("th", {}, "PCR"), el("th", {}, "SHA-256")),
      Object.entries(tpm.pcrs).map(([i, v]) => el("tr", {}, el("td", {}, i), el("td", { class: "mono" }, v)))),
    el("table", { class: "tpm-measured" },
      el("tr", {}, ["PCR", "event", "digest", "matched"].map((h) => el("th", {}, h))),
      tpm.measurements.map((m) => el("tr", {},
        el("td", {}, String(m.pcr)), el("td", {}, m.event), el("td", { class: "mono" }, m.digest),
        m.matched ? el("td", {}, m.matched) : el("td", { class: "error" }, "not given to this boot")))));
}

function gpuVerdict(v) {
  if (!v) return el("p", {}, "No validation yet.");
  if (v.passed) return el("p", { id: "validation" }, `Validation passed (boot ${v.boot_id}, ${v.gpus.length} GPUs).`);
  return el("table", { id: "validation" },
    el("tr", {}, el("th", {}, "GPU"), el("th", {}, "check"), el("th", {}, "why")),
    v.failures.map((f) => el("tr", { class: "failure" },
      el("td", { class: "gpu" }, f.gpu === null || f.gpu === undefined ? "node" : `GPU ${f.gpu}`),
      el("td", { class: "check" }, f.check), el("td", {}, f.reason))));
}

async function nodeView(view, mac) {
  const draw = async () => {
    const d = (await api("GET", `/api/v1/nodes/${mac}`)).data;
    const reason = el("input", { type: "text", id: "reimage-reason", placeholder: "why (required)", size: 40 });
    const assign = el("input", { type: "text", id: "assign-ref", placeholder: "image: name:tag, name:version or sha256:…", size: 40 });
    const act = async (what, path, body) => {
      try {
        await api("POST", path, body);
        status(`${what}: asked`);
        await draw();
      } catch (e) { status(`${what}: ${e.message}`, true); }
    };
    view.replaceChildren(
      el("h1", {}, `Node ${d.mac}`, d.hostname ? ` (${d.hostname})` : ""),
      el("p", {}, "State: ", el("span", { id: "node-state", class: `state ${d.state}` }, d.state),
        " ", el("span", { id: "node-reason" }, d.state_reason)),
      el("p", {}, `Assigned: ${d.assigned || "-"}. Labels: `,
        Object.entries(d.labels).map(([k, v]) => `${k}=${v}`).join(" ") || "none"),
      el("div", { class: "actions" }, reason,
        el("button", { id: "reimage", type: "button", on: { click: () => {
          if (!reason.value.trim()) { status("a reimage needs a reason", true); return; }
          act("reimage", `/api/v1/nodes/${mac}/reimage`, { reason: reason.value.trim() });
        } } }, "Reimage"),
        el("button", { id: "revalidate", type: "button", on: { click: () =>
          act("revalidate", `/api/v1/nodes/${mac}/revalidate`) } }, "Revalidate"),
        d.bmc ? ["on", "off", "soft-off", "cycle"].map((a) =>
          el("button", { type: "button", class: "power", "data-action": a, on: { click: () => {
            if (!reason.value.trim()) { status(`power ${a} needs a reason`, true); return; }
            act(`power ${a}`, `/api/v1/nodes/${mac}/power`, { action: a, reason: reason.value.trim() });
          } } }, `Power ${a}`)) : null),
      el("div", { class: "actions" }, assign,
        el("button", { id: "assign", type: "button", on: { click: async () => {
          if (!assign.value.trim()) { status("assign needs an image REF", true); return; }
          try {
            await api("PUT", `/api/v1/nodes/${mac}/image`, { image: assign.value.trim() });
            status(`assigned ${assign.value.trim()} from the next boot`);
            await draw();
          } catch (e) { status(`assign: ${e.message}`, true); }
        } } }, "Assign")),
      el("h2", {}, "GPUs: the last validation"), gpuVerdict(d.validation),
      el("h2", {}, "Boots"), ...(d.boots.length ? d.boots.map(waterfall) : [el("p", {}, "No boot yet.")]),
      el("h2", {}, "History"),
      el("table", { id: "history" }, d.history.slice().reverse().map((h) => el("tr", {},
        el("td", {}, h.at), el("td", {}, h.from || ""), el("td", {}, "→"), el("td", {}, stateBadge(h.to)),
        el("td", {}, h.reason), el("td", { class: "actor" }, h.actor ? `by ${h.actor}` : "")))));
  };
  await draw();
  // Live: each event about this node redraws it.
  // Events are named by kind: listen to those that change what the page shows.
  live = new EventSource(`/api/v1/events/stream?node=${encodeURIComponent(mac)}`);
  const redraw = () => draw().catch((e) => status(e.message, true));
  for (const kind of ["node.state", "node.power", "node.bmc", "reimage.refused", "report.refused", "node.removed"]) {
    live.addEventListener(kind, redraw);
  }
  live.addEventListener("error", () => status("live updates interrupted; retrying", true));
}

// --- images and tags -------------------------------------------------------------

async function imagesView(view) {
  const [images, tags] = await Promise.all([api("GET", "/api/v1/images"), api("GET", "/api/v1/tags")]);
  const tagRows = [];
  for (const t of tags.data) {
    const name = t.tag;
    const cut = name.lastIndexOf(":");
    const [n, tg] = [name.slice(0, cut), name.slice(cut + 1)];
    const history = (await api("GET", `/api/v1/tags/${encodeURIComponent(n)}/${encodeURIComponent(tg)}/history`)).data;
    const earlier = [];
    const seen = new Set([String(t.digest)]);
    for (const h of history.slice().reverse()) {
      const to = String(h.to);
      if (seen.has(to)) continue;
      seen.add(to);
      earlier.push(el("div", {}, `${h.to_version || ""} ${to.slice(0, 19)} (tagged ${h.at}) `,
        el("button", { type: "button", class: "rollback", "data-tag": name, "data-version": h.to_version || "",
          on: { click: async () => {
            try {
              await api("PUT", `/api/v1/tags/${encodeURIComponent(n)}/${encodeURIComponent(tg)}`, { image: to });
              status(`${name} rolled back to ${h.to_version || to}`);
              await route();
            } catch (e) { status(e.message, true); }
          } } }, "roll back to this")));
    }
    tagRows.push(el("tr", {}, el("td", {}, name),
      el("td", { class: "tag-digest", "data-tag": name }, String(t.digest)), el("td", {}, earlier)));
  }
  view.append(
    el("h1", {}, "Images"),
    el("table", { id: "images" },
      el("tr", {}, ["name:version", "digest", "tags", "published", "state"].map((h) => el("th", {}, h))),
      images.data.map((i) => el("tr", {}, el("td", {}, `${i.name}:${i.version}`), el("td", {}, i.digest),
        el("td", {}, i.tags.join(" ")), el("td", {}, i.created_at),
        el("td", { class: i.broken ? "error" : "" }, i.broken || "whole")))),
    el("h2", {}, "Tags and their history"),
    el("table", { id: "tags" }, el("tr", {}, el("th", {}, "tag"), el("th", {}, "points at"),
      el("th", {}, "earlier")), tagRows));
}

// --- rollouts --------------------------------------------------------------------

async function rolloutsView(view) {
  const rollouts = (await api("GET", "/api/v1/rollouts")).data;
  const reason = el("input", { type: "text", id: "rollout-reason", placeholder: "why (required)", size: 40 });
  const act = (id, action) => async () => {
    if (!reason.value.trim()) { status(`${action} needs a reason`, true); return; }
    try {
      await api("POST", `/api/v1/rollouts/${id}/${action}`, { reason: reason.value.trim() });
      status(`rollout ${id}: ${action} asked`);
      await route();
    } catch (e) { status(e.message, true); }
  };
  view.append(el("h1", {}, "Rollouts"),
    rollouts.length === 0 ? el("p", {}, "No rollout yet.") : el("div", {},
      el("div", { class: "actions" }, reason),
      el("table", { id: "rollouts" },
        el("tr", {}, ["id", "image", "selector", "state", "wave", "nodes done / failed / all", "why", ""].map((h) => el("th", {}, h))),
        rollouts.map((r) => el("tr", {}, el("td", {}, r.id), el("td", {}, r.image), el("td", {}, r.selector),
          el("td", {}, r.state), el("td", {}, `${r.wave} of ${r.waves}`),
          el("td", {}, `${r.done} / ${r.failed} / ${r.nodes}`), el("td", {}, r.state_reason),
          el("td", {}, ["pause", "resume", "abort", "rollback"].map((a) =>
            el("button", { type: "button", on: { click: act(r.id, a) } }, a))))))));
}

// --- routing ---------------------------------------------------------------------

async function route() {
  if (live) { live.close(); live = null; }
  if (!csrf) {
    const r = await fetch("/ui/session", { credentials: "same-origin" });
    if (!r.ok) { showLogin(); return; }
    startSession(await r.json());
  }
  document.getElementById("login-form").hidden = true;
  document.getElementById("nav").hidden = false;
  const view = document.getElementById("view");
  view.replaceChildren();
  const [path, query] = (location.hash.slice(1) || "/").split("?");
  const params = new URLSearchParams(query || "");
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.getAttribute("href") === `#${path}`);
  try {
    if (path === "/" || path === "") await fleetView(view);
    else if (path === "/nodes") await nodesView(view, params);
    else if (path.startsWith("/node/")) await nodeView(view, decodeURIComponent(path.slice(6)));
    else if (path === "/images") await imagesView(view);
    else if (path === "/rollouts") await rolloutsView(view);
    else view.append(el("p", {}, "No such page."));
    status(`updated ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    if (e.message !== "logged out") status(e.message, true);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login-form").addEventListener("submit", login);
  document.getElementById("logout").addEventListener("click", logout);
  window.addEventListener("hashchange", route);
  route();
});
