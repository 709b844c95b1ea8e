// Shared by the dashboard's pages: readable units, API calls that track freshness, small SVG charts.
// Self-contained on purpose (no CDN): GPU clusters are often air-gapped.
"use strict";

const REFRESH_MS = 2000;

// ---- units --------------------------------------------------------------------------------------------------------

const exactFormat = new Intl.NumberFormat("en-US");
const compactFormat = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });

function exact(n) {
  return n === null || n === undefined ? "–" : exactFormat.format(Math.round(n));
}

function compact(n) {
  if (n === null || n === undefined) return "–";
  return Math.abs(n) < 10000 ? exactFormat.format(Math.round(n)) : compactFormat.format(n);
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "kB", "MB", "GB", "TB", "PB"];
  let value = Math.abs(n);
  let unit = 0;
  while (value >= 999.5 && unit < units.length - 1) { // 999.7 MB reads 1.00 GB, not "1000 MB"
    value /= 1000;
    unit += 1;
  }
  const digits = unit === 0 || value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return (n < 0 ? "−" : "") + value.toFixed(digits) + " " + units[unit];
}

function duration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 10) return s.toFixed(1) + " s";
  if (s < 90) return s.toFixed(0) + " s";
  if (s < 90 * 60) return (s / 60).toFixed(0) + " min";
  if (s < 48 * 3600) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function clock(tsSeconds) {
  // Today: the time; within a week: weekday and time; later: the date.
  const d = new Date(tsSeconds * 1000);
  const time = d.toLocaleTimeString("en-GB", { hour: "2-digit", minute: "2-digit" });
  const days = Math.abs(tsSeconds * 1000 - Date.now()) / 86400e3;
  if (d.toDateString() === new Date().toDateString()) return time;
  if (days < 6) return d.toLocaleDateString("en-GB", { weekday: "short" }) + " " + time;
  return d.toLocaleDateString("en-GB", { day: "numeric", month: "short" }) + " " + time;
}

function percent(part, whole) {
  return whole ? (100 * part) / whole : 0;
}

function escapeHtml(value) {
  return String(value).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// ---- job state, as the operator reads it ---------------------------------------------------------------------------

const FINISHED = new Set(["completed", "completed_with_errors", "cancelled"]);

function stateBadge(state) {
  return `<span class="state state-${state}" data-state="${state}">${state.replaceAll("_", " ")}</span>`;
}

// A paused job says why under its state (storage full, ...): it goes on by itself once the reason is gone.
function pausedReason(p) {
  if (p.paused_reason === null || p.paused_reason === undefined) return "";
  const short = p.paused_reason.length > 60 ? p.paused_reason.slice(0, 60) + "…" : p.paused_reason;
  return `<div class="sub warn" data-field="paused_reason" title="${escapeHtml(p.paused_reason)}">paused: ${escapeHtml(short)}</div>`;
}

function stalledFlag(activity) {
  if (!activity.stalled) return "";
  return `<span class="flag stalled" data-stalled="true" title="queued or running, and no shard committed for ${duration(
    activity.seconds_since_commit,
  )} (limit ${duration(activity.stall_after_s)})">stalled ${duration(activity.seconds_since_commit)}</span>`;
}

// The rate cell: a live rate while running, the average (marked) once finished, "starting" before the first shard.
function rateCell(p, activity) {
  if (FINISHED.has(p.state)) {
    return `<span class="muted" title="average over the whole job">avg ${compact(p.tokens_per_second)}/s</span>`;
  }
  if (activity.last_commit_ts === null && !activity.stalled) {
    return `<span class="muted" title="no shard committed yet">starting</span>`;
  }
  return `${compact(p.tokens_per_second)}/s`;
}

function etaCell(p, serverTs) {
  if (p.state === "cancelled") return '<span class="muted">cancelled</span>';
  if (FINISHED.has(p.state)) return '<span class="muted">done</span>';
  if (p.eta_seconds === null) return '<span class="muted" title="no recent commit to estimate from">–</span>';
  return `${duration(p.eta_seconds)}<div class="sub">at ${clock(serverTs + p.eta_seconds)}</div>`;
}

function headroomCell(p) {
  if (p.storage_budget_bytes === null) return '<span class="muted">no budget</span>';
  const cls = p.budget_headroom_bytes < 0 ? "bad" : p.budget_headroom_bytes < 0.1 * p.storage_budget_bytes ? "warn" : "";
  return `<span class="${cls}">${bytes(p.budget_headroom_bytes)}</span><div class="sub">of ${bytes(p.storage_budget_bytes)}</div>`;
}

// ---- API calls with freshness -------------------------------------------------------------------------------------

// Every page shows when its numbers were last read, and a banner once the API stops answering: frozen numbers
// must never look live.
const freshness = { lastOk: null, lastError: null, failingSince: null };

function authHeaders() {
  const token = sessionStorage.getItem("eagle3-api-token");
  return token ? { Authorization: "Bearer " + token } : {};
}

async function api(path) {
  const response = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  if (response.status === 401) {
    askForToken();
    throw new Error("the API wants a bearer token (EAGLE3_API_TOKEN)");
  }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function askForToken() {
  const box = document.getElementById("token-box");
  if (box) box.hidden = false;
}

function saveToken(event) {
  event.preventDefault();
  sessionStorage.setItem("eagle3-api-token", document.getElementById("token-input").value);
  document.getElementById("token-box").hidden = true;
}

function noteSuccess() {
  freshness.lastOk = Date.now();
  freshness.lastError = null;
  freshness.failingSince = null;
  renderFreshness();
}

function noteFailure(error) {
  freshness.lastError = String(error.message || error);
  freshness.failingSince = freshness.failingSince || Date.now();
  renderFreshness();
}

function renderFreshness() {
  const line = document.getElementById("freshness");
  const banner = document.getElementById("stale-banner");
  const now = Date.now();
  const age = freshness.lastOk === null ? null : (now - freshness.lastOk) / 1000;
  const stale = freshness.failingSince !== null || (age !== null && age > (3 * REFRESH_MS) / 1000);
  line.textContent =
    age === null ? "waiting for the API…" : `updated ${age < 90 ? Math.round(age) + " s" : duration(age)} ago, every ${REFRESH_MS / 1000} s`;
  line.classList.toggle("bad", stale);
  banner.hidden = !stale;
  if (stale) {
    const since = freshness.lastOk === null ? "the page loaded" : new Date(freshness.lastOk).toLocaleTimeString("en-GB");
    banner.textContent =
      `The API is not answering (${freshness.lastError || "no reply"}). ` +
      `Every number on this page is from ${since}, ${age === null ? "" : duration(age) + " ago"}; not live.`;
  }
  document.body.classList.toggle("stale", stale);
}

function poll(refresh, intervalMs = REFRESH_MS) {
  async function tick() {
    try {
      await refresh();
      noteSuccess();
    } catch (error) {
      noteFailure(error);
    }
  }
  tick();
  setInterval(tick, intervalMs);
  setInterval(renderFreshness, 1000);
}

// ---- charts: one SVG line over time -------------------------------------------------------------------------------

function lineChart(points, { value, label, color, format }) {
  const width = 640, height = 200, left = 64, right = 12, top = 12, bottom = 28;
  if (points.length < 2) return `<p class="muted">no data yet</p>`;
  const xs = points.map((p) => p.ts);
  const ys = points.map(value);
  const xLo = xs[0], xHi = xs[xs.length - 1];
  const yHi = Math.max(...ys, 1e-9);
  const x = (t) => left + ((t - xLo) / (xHi - xLo || 1)) * (width - left - right);
  const y = (v) => top + (1 - v / yHi) * (height - top - bottom);
  const path = points.map((p, i) => `${i ? "L" : "M"}${x(p.ts).toFixed(1)},${y(value(p)).toFixed(1)}`).join("");
  const ticks = [0, 0.5, 1].map(
    (f) => `<text x="${left - 6}" y="${y(f * yHi) + 4}" text-anchor="end">${format(f * yHi)}</text>
            <line x1="${left}" x2="${width - right}" y1="${y(f * yHi)}" y2="${y(f * yHi)}" class="grid"/>`,
  );
  const times = [0, 0.5, 1].map((f) => {
    const t = xLo + f * (xHi - xLo);
    const label = xHi - xLo < 600 ? new Date(t * 1000).toLocaleTimeString("en-GB") : clock(t);
    return `<text x="${x(t)}" y="${height - 8}" text-anchor="${f === 0 ? "start" : f === 1 ? "end" : "middle"}">${label}</text>`;
  });
  return `<svg viewBox="0 0 ${width} ${height}" role="img" aria-label="${escapeHtml(label)}" class="chart">
    ${ticks.join("")}${times.join("")}
    <path d="${path}" fill="none" stroke="${color}" stroke-width="2"/></svg>`;
}
