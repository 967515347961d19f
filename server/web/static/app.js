// hangwatch dashboard: keeps the server-rendered pages fresh by polling the JSON API.
// Every value from the API is untrusted (it comes from dumps and agents): it is only
// ever written with textContent or setAttribute, never as HTML.
"use strict";

(function () {
  const POLL_MS = 1500;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function link(href, text) {
    const a = el("a", text);
    a.setAttribute("href", href);
    return a;
  }

  function age(s) {
    if (s === null || s === undefined) return "-";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  function ranges(ranks, limit) {
    const rs = Array.from(new Set(ranks || [])).sort((a, b) => a - b);
    if (!rs.length) return "none";
    const spans = [];
    let start = rs[0], prev = rs[0];
    for (const r of rs.slice(1)) {
      if (r === prev + 1) { prev = r; continue; }
      spans.push([start, prev]); start = prev = r;
    }
    spans.push([start, prev]);
    const shown = limit ? spans.slice(0, limit) : spans;
    let text = shown.map(([a, b]) => (a === b ? String(a) : a + "-" + b)).join(", ");
    if (shown.length < spans.length) {
      const rest = spans.slice(shown.length).reduce((n, [a, b]) => n + b - a + 1, 0);
      text += " (+" + rest + " more)";
    }
    return text;
  }

  function when(unix) {
    if (unix === null || unix === undefined) return "unknown";
    return new Date(unix * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  }

  // A job's state badge, as templates/job_state.html draws it.
  function jobStateBadge(j) {
    // As job_state.html: a live job with an open incident is "hung", one with a
    // stalled collective and no incident yet "stalled", both in red.
    const stuck = j.stalled_groups || (j.stalled && j.stalled.length);
    if (j.state === "live" && j.open_incident) {
      const b = el("span", "hung", "badge badge-hang job-state");
      b.title = "an incident is open: the job is hung";
      return b;
    }
    if (j.state === "live" && stuck) {
      const b = el("span", "stalled", "badge badge-hang job-state");
      b.title = "a collective is stalled; no incident yet";
      return b;
    }
    if (j.state === "live") return el("span", "live", "badge badge-healthy job-state");
    if (j.state === "ended") {
      const b = el("span", "ended", "badge badge-ended job-state");
      b.title = j.ended_reason || "";
      return b;
    }
    return el("span", "history", "badge job-state");
  }

  function setLive(ok) {
    const s = document.getElementById("live-status");
    if (!s) return;
    // The job page's badge names the job's state; this names the page's freshness
    // (the lists, which have no badge, say "live" too).
    const what = s.dataset.state === undefined ? "live · " : s.dataset.state === "history" ? "no live state: history only · " : "";
    s.textContent = ok ? what + "updated " + new Date().toLocaleTimeString() : what + "connection lost, retrying";
    s.classList.toggle("stale", !ok);
  }

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    // Token rotated or session gone: reloading shows the login form.
    if (r.status === 401) { location.reload(); throw new Error("unauthorized"); }
    if (!r.ok) throw new Error(url + ": HTTP " + r.status);
    return r.json();
  }

  function poll(fn) {
    let busy = false;
    async function tick() {
      if (busy || document.hidden) return;
      busy = true;
      try { await fn(); setLive(true); } catch (e) { setLive(false); } finally { busy = false; }
    }
    setInterval(tick, POLL_MS);
  }

  function fillBody(table, rows, emptyText, ncols) {
    const tbody = table.tBodies[0];
    const frag = document.createDocumentFragment();
    if (!rows.length) {
      const tr = el("tr", null, "empty");
      const td = el("td", emptyText, "muted");
      td.setAttribute("colspan", String(ncols));
      tr.appendChild(td);
      frag.appendChild(tr);
    }
    for (const cells of rows) {
      const tr = el("tr");
      for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", c));
      frag.appendChild(tr);
    }
    tbody.replaceChildren(frag);
  }

  // FR's -1 means "nothing yet": people read "none", never "#-1".
  function seq(n) { return n === null || n === undefined || n < 0 ? "none" : "#" + n; }

  function td(child, cls) {
    const t = el("td", null, cls);
    if (child instanceof Node) t.appendChild(child); else t.textContent = String(child);
    return t;
  }

  // ---- job page: heat map, stalled table, groups, agents ----
  function tooltip(r) {
    const parts = ["rank " + r.rank, r.host, r.process_state];
    if (!r.observed) parts.push("unobserved (agent lost)");
    parts.push("lag " + r.lag + (r.p2p ? " (collectives; its p2p ops are not counted)" : ""));
    if (r.last_completed !== null && r.last_completed !== undefined) parts.push("last completed " + seq(r.last_completed));
    if (r.in_flight_op) parts.push("in flight " + r.in_flight_op + " " + seq(r.in_flight_seq) + " for " + age(r.in_flight_age_s));
    if (r.suspect) parts.push("has not entered a stalled collective");
    return parts.join(" | ");
  }

  function updateHeatmap(job) {
    const grid = document.getElementById("heatmap");
    if (!grid) return;
    const byRank = new Map(job.ranks.map((r) => [r.rank, r]));
    let top = (job.world_size || 0) - 1;
    for (const r of job.ranks) top = Math.max(top, r.rank);
    for (const r of job.missing_ranks) top = Math.max(top, r);
    const n = top + 1;
    if (grid.children.length !== n) {
      const frag = document.createDocumentFragment();
      for (let i = 0; i < n; i++) {
        const c = el("div", null, "cell");
        c.setAttribute("role", "listitem");
        c.setAttribute("data-rank", String(i));
        frag.appendChild(c);
      }
      grid.replaceChildren(frag);
      grid.classList.toggle("large", n > 256);
    }
    for (let i = 0; i < n; i++) {
      const cell = grid.children[i];
      const r = byRank.get(i);
      const cls = "cell " + (r ? r.lag_bucket : "unobserved") + (r && r.suspect ? " stalled" : "");
      if (cell.className !== cls) cell.className = cls;
      const tip = r ? tooltip(r) : "rank " + i + " | not registered by any agent";
      if (cell.getAttribute("title") !== tip) cell.setAttribute("title", tip);
    }
  }

  function jobPage() {
    const job = document.body.getAttribute("data-job");
    const url = "/api/jobs/" + encodeURIComponent(job) + "/ranks";
    poll(async () => {
      const j = await getJSON(url);
      updateHeatmap(j);
      const set = (id, v) => { const e = document.getElementById(id); if (e) e.textContent = v; };
      const ls = document.getElementById("live-status");
      if (ls) ls.dataset.state = j.state;
      const badge = document.querySelector("h1 .job-state");
      if (badge) badge.replaceWith(jobStateBadge(j));
      set("world-size", j.world_size === null ? "unknown" : j.world_size);
      set("ranks-registered", j.ranks.length);
      set("oldest-inflight", age(j.oldest_inflight_age_s));
      const oi = document.getElementById("open-incident");
      if (oi) oi.replaceChildren(j.open_incident ? link("/incidents/" + encodeURIComponent(j.open_incident), j.open_incident) : document.createTextNode("none"));
      const st = document.getElementById("stalled-table");
      if (st) {
        fillBody(st, j.stalled.map((s) => [
          td(s.group + (s.group_desc ? " " + s.group_desc : ""), "mono"), td(s.op, "mono"), td(seq(s.seq), "num"), td(s.kind),
          td(ranges(s.waiting_ranks, 4)), td(ranges(s.not_entered_ranks, 4), "bad"),
          td(s.dead_ranks.length ? ranges(s.dead_ranks, 4) : "-"), td(s.unobserved_ranks.length ? ranges(s.unobserved_ranks, 4) : "-"),
          td(age(s.stalled_for_s), "num"),
        ]), "Nothing stalled.", 9);
        for (const [i, s] of j.stalled.entries()) st.tBodies[0].rows[i].className = s.over_timeout ? "over-timeout" : "";
      }
      const gt = document.getElementById("groups-table");
      if (gt) {
        fillBody(gt, j.groups.map((g) => [
          td(g.name, "mono"), td(g.desc, "mono"), td(ranges(g.ranks, 4) + " (" + g.ranks.length + ")"),
          td(seq(g.min_completed), "num"), td(seq(g.max_completed), "num"), td(seq(g.max_enqueued), "num"),
          td(age(g.no_progress_for_s), "num"),
        ]), "No groups.", 7);
      }
      set("agents-summary", j.agents.filter((a) => a.connected).length + " of " + j.agents.length + " connected");
      const at = document.getElementById("agents-table");
      if (at) {
        // Lost agents first: they are the ones to look at.
        j.agents.sort((a, b) => Number(a.connected) - Number(b.connected));
        fillBody(at, j.agents.map((a) => [
          td(a.agent_id, "mono"), td(a.host), td(ranges(a.ranks, 4)),
          td(a.connected ? "connected" : "lost", a.connected ? "ok" : "bad"),
          td(a.watching ? "open" : "closed"), td(age(a.last_report_age_s) + " ago", "num"),
        ]), "No agents.", 6);
      }
    });
  }

  // ---- job page: lateness strip and stragglers (job_stragglers.html) ----
  function latenessBucket(score) {
    return score < 0.02 ? "lag0" : score < 0.05 ? "lag1" : score < 0.1 ? "lag2" : score < 0.25 ? "lag3" : "lag4";
  }

  function stragglersPanel() {
    const strip = document.getElementById("lateness-map");
    const table = document.getElementById("stragglers-table");
    if (!strip || !table) return;
    const url = "/api/jobs/" + encodeURIComponent(document.body.getAttribute("data-job")) + "/stragglers";
    const pct = (x) => (100 * x).toFixed(1) + "%";
    poll(async () => {
      const s = await getJSON(url);
      strip.replaceChildren(...s.ranks.map((r) => {
        const c = el("div", null, "cell " + latenessBucket(r.score) + (r.straggler ? " stalled" : ""));
        c.setAttribute("role", "listitem");
        c.setAttribute("data-rank", String(r.rank));
        c.setAttribute("title", "rank " + r.rank + " | " + r.host + " | behind " + pct(r.score) + " of the time | " +
          r.late_ms.toFixed(1) + " ms late | group " + r.group +
          // As job_stragglers.html: the strip says which a red rank is.
          (r.straggler ? " | a straggler" : r.long_run ? " | one long run, not a straggler (a pause or a hang)" : ""));
        return c;
      }));
      fillBody(table, s.stragglers.map((x) => [
        td(x.rank, "num bad"), td(x.host), td(pct(x.score), "num"), td(x.late_ms.toFixed(1) + " ms", "num"),
        td(x.kind), td(x.group, "mono"), td(when(x.since), "num"),
      ]), s.none_named || "No stragglers.", 7);
    });
  }

  // ---- incident lists (jobs page and incidents page) ----
  function incidentRows(items) {
    return items.map((i) => {
      const verdict = i.verdict ? el("span", i.verdict, "badge badge-" + i.verdict) : "-";
      return [
        td(link("/incidents/" + encodeURIComponent(i.id), when(i.created))),
        td(link("/jobs/" + encodeURIComponent(i.job), i.job)),
        td(verdict),
        td(i.summary || ""),
        td(i.lagging_ranks.length ? ranges(i.lagging_ranks, 4) : "-"),
        td(statusCell(i)),
      ];
    });
  }

  // resolved: a transient stall that cleared by itself; ended: the job stopped.
  function statusCell(i) {
    const badge = el("span", i.status, "badge badge-" + i.status);
    if (i.close_reason) badge.title = i.close_reason;
    if (i.status !== "resolved") return badge;
    const wrap = document.createElement("span");
    const note = "transient" + (i.stall_s === null || i.stall_s === undefined ? "" : ", " + age(i.stall_s));
    wrap.append(badge, " ", el("span", note, "muted"));
    return wrap;
  }

  function incidentsQuery() {
    const form = document.getElementById("filters");
    const q = new URLSearchParams();
    if (form) {
      for (const [k, v] of new FormData(form).entries()) if (v) q.set(k, String(v));
    } else {
      q.set("limit", "10");
    }
    return q;
  }

  function incidentsPage() {
    poll(async () => {
      const items = await getJSON("/api/incidents?" + incidentsQuery().toString());
      fillBody(document.getElementById("incidents-table"), incidentRows(items), "No incidents.", 6);
    });
  }

  function jobsPage() {
    poll(async () => {
      const [jobs, items] = await Promise.all([
        getJSON("/api/jobs"),
        getJSON("/api/incidents?limit=10"),
      ]);
      fillBody(document.getElementById("jobs-table"), jobs.map((j) => [
        td(link("/jobs/" + encodeURIComponent(j.job), j.job)),
        td(jobStateBadge(j)),
        td(j.world_size === null ? "-" : j.world_size, "num"),
        td(j.agents_connected + "/" + j.agents_total, "num"),
        td(j.ranks_observed + "/" + j.ranks_registered, "num"),
        td(j.stalled_groups, "num" + (j.stalled_groups ? " bad" : "")),
        td(age(j.oldest_inflight_age_s), "num"),
        td(j.open_incident ? link("/incidents/" + encodeURIComponent(j.open_incident), j.open_incident) : "-"),
        td(j.incidents, "num"),
      ]), "No job has reported yet.", 9);
      fillBody(document.getElementById("incidents-table"), incidentRows(items), "No incidents.", 6);
    });
  }

  // A pending incident page reloads itself once the verdict is stored.
  function pendingPage() {
    const id = decodeURIComponent(location.pathname.split("/").pop());
    poll(async () => {
      const i = await getJSON("/api/incidents/" + encodeURIComponent(id));
      if (i.status !== "collecting") location.reload();
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const page = document.body.getAttribute("data-page");
    if (page === "job") { jobPage(); stragglersPanel(); }
    else if (page === "incidents") incidentsPage();
    else if (page === "jobs") jobsPage();
    else if (page === "incident-pending") pendingPage();
  });
})();
