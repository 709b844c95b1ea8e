// One job: its numbers, settings, charts over time, dead letters, rejected lines and trainer curves.
"use strict";

const jobId = decodeURIComponent(location.pathname.split("/").pop());
const SHOWN_ROWS = 200; // rows of rejected lines and dead letters drawn; the API has them all
let staticPartsShown = false;
let trainerRunsShown = "";

function card(label, value, field, sub = "") {
  return `<div class="card"><div class="label">${label}</div><div class="value" data-field="${field}">${value}</div>${sub ? `<div class="sub">${sub}</div>` : ""}</div>`;
}

function renderCards(p, a, serverTs) {
  document.getElementById("cards").innerHTML = [
    card("progress", `${percent(p.tokens_done, p.tokens_total).toFixed(1)}%`, "percent", `${exact(p.tokens_done)} / ${exact(p.tokens_total)} tokens`),
    card("tokens/s", rateCell(p, a), "tokens_per_second", a.last_commit_ts === null ? "no shard committed yet" : `last commit ${duration(a.seconds_since_commit)} ago`),
    card("ETA", etaCell(p, serverTs), "eta"),
    card("elapsed", duration(p.elapsed_seconds), "elapsed", `created ${clock(Date.parse(p.created_at) / 1000)}`),
    card("samples", `${exact(p.samples_done)} / ${exact(p.samples_total)}`, "samples_done", `<span class="${p.samples_failed ? "bad" : ""}">${exact(p.samples_failed)} failed</span> · ${exact(p.samples_rejected)} rejected`),
    card("shards", `${exact(p.shards_committed)} / ${exact(p.shards_total)}`, "shards_committed", `<span class="${p.shards_dead_lettered ? "bad" : ""}">${exact(p.shards_dead_lettered)} dead-lettered</span>`),
    card("stored", bytes(p.bytes_stored), "bytes_stored", `projected ${bytes(p.projected_total_bytes)} · ${compact(p.bytes_per_token)} B/token`),
    card("budget headroom", headroomCell(p), "headroom"),
    // The job kind's own counters, whichever kind it is.
    ...Object.entries(p.counters || {}).map(([name, value]) => card(escapeHtml(name.replaceAll("_", " ")), exact(value), escapeHtml(name))),
  ].join("");
  document.getElementById("job-state").innerHTML = `<span class="kind">${p.kind}</span> ${stateBadge(p.state)}${stalledFlag(a)}${pausedReason(p)}`;
}

function renderSettings(details) {
  const { job } = details;
  const spec = job.spec;
  const rows = [
    ["kind", job.spec.kind],
    ["model", `<span class="mono">${escapeHtml(job.model.path)}</span>`],
    ["architecture", `${escapeHtml(job.model.architecture)}, ${job.model.num_hidden_layers} layers, hidden ${job.model.hidden_size}, vocab ${exact(job.model.vocab_size)}`],
    ["aux layer ids", `<span data-field="aux_layer_ids">${job.aux_layer_ids.join(", ")}</span>`],
    ["dtype", `${job.dtype}, ${exact(job.bytes_per_token)} bytes/token raw`],
    ["storage", `<span class="mono" data-field="storage_root">${escapeHtml(details.storage_root)}</span>`],
    ["dataset", `<span class="mono">${escapeHtml(spec.dataset_url)}</span>`],
    ["max length", `${exact(spec.max_length)} (${spec.length_policy})`],
    ["shard budget", `${exact(spec.shard_token_budget)} tokens`],
    ["draft vocab", `${exact(job.draft_vocab_size)} (coverage ${(100 * job.vocab_coverage).toFixed(1)}%)`],
    ...(Object.keys(details.kind_options).length
      ? [[`${escapeHtml(job.spec.kind)} options`, `<span class="mono" data-field="kind_options">${Object.entries(details.kind_options).map(([k, v]) => `${escapeHtml(k)}=${escapeHtml(JSON.stringify(v))}`).join(" ")}</span>`]]
      : []),
    ["created", `${escapeHtml(job.created_at)}`],
    ["versions", Object.entries(job.versions).map(([k, v]) => `${escapeHtml(k)} ${escapeHtml(v)}`).join(", ")],
  ];
  document.getElementById("settings").innerHTML = rows.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
  document.title = `EAGLE-3 factory: ${job.job_id}`;
  document.getElementById("job-id").textContent = job.job_id;
}

function renderDeadLetters(letters) {
  document.getElementById("dead-count").textContent = letters.length ? `${letters.length}` : "none";
  document.querySelector("#dead-letters tbody").innerHTML = letters
    .slice(0, SHOWN_ROWS)
    .map(
      (d) => `<tr data-shard="${d.shard_index}"><td>${d.shard_index}</td><td class="left">${escapeHtml(d.error_type)}</td>
      <td class="left wrap">${escapeHtml(d.reason)}</td><td>${d.retries}</td><td class="left mono">${escapeHtml(d.worker)}</td>
      <td class="left">${escapeHtml(d.at)}</td></tr>`,
    )
    .join("");
}

function renderRejected(rejected) {
  const more = rejected.length > SHOWN_ROWS ? `, first ${SHOWN_ROWS} shown (all: /v1/jobs/${jobId}/rejected)` : "";
  document.getElementById("rejected-count").textContent = rejected.length ? `${exact(rejected.length)}${more}` : "none";
  document.querySelector("#rejected tbody").innerHTML = rejected
    .slice(0, SHOWN_ROWS)
    .map(
      (r) => `<tr data-line="${r.line}"><td>${r.line}</td><td class="left mono">${escapeHtml(r.sample_id)}</td>
      <td class="left">${escapeHtml(r.field)}</td><td class="left wrap">${escapeHtml(r.reason)}</td></tr>`,
    )
    .join("");
}

function renderTrainer(runs) {
  const key = JSON.stringify(runs);
  if (key === trainerRunsShown) return; // reloading the frames every 2 s would flicker
  trainerRunsShown = key;
  document.getElementById("trainer-count").textContent = runs.length ? `${runs.length} run${runs.length > 1 ? "s" : ""}` : "no run follows this job";
  document.getElementById("trainer").innerHTML = runs
    .map((run) => {
      const base = `/v1/jobs/${encodeURIComponent(jobId)}/trainer/${encodeURIComponent(run.run_name)}`;
      const step = run.latest_step === null ? "no checkpoint yet" : `step ${exact(run.latest_step)}, saved ${escapeHtml(run.saved_at || "")}`;
      const curves = run.has_curves
        ? `<iframe class="curves" sandbox title="training curves of ${escapeHtml(run.run_name)}" src="${base}/curves"></iframe>`
        : "";
      return `<h3 data-run="${escapeHtml(run.run_name)}">${escapeHtml(run.run_name)} <span class="muted">${step}</span></h3>${curves}`;
    })
    .join("");
}

async function refreshTimeline() {
  const t = await api(`/v1/jobs/${encodeURIComponent(jobId)}/timeline?points=120`);
  document.getElementById("interval").textContent = `(${duration(t.interval_s)} per point)`;
  document.getElementById("rate-chart").innerHTML = lineChart(t.points, {
    value: (p) => p.tokens_per_second, label: "committed tokens per second", color: "#1f5fbf", format: compact,
  });
  document.getElementById("shards-chart").innerHTML = lineChart(t.points, {
    value: (p) => p.shards_committed, label: "committed shards", color: "#1a7f4b", format: compact,
  });
}

let refreshes = 0;
async function refresh() {
  const details = await api(`/v1/jobs/${encodeURIComponent(jobId)}/details`);
  const serverTs = Date.now() / 1000;
  renderCards(details.progress, details.activity, serverTs);
  renderDeadLetters(details.dead_letters);
  renderTrainer(details.trainer_runs);
  if (!staticPartsShown) {
    renderSettings(details);
    renderRejected(await api(`/v1/jobs/${encodeURIComponent(jobId)}/rejected`));
    staticPartsShown = true;
  }
  // The timeline reads the whole event stream: every 5th refresh is plenty for a chart.
  if (refreshes++ % 5 === 0) await refreshTimeline();
}

poll(refresh);
