// The jobs list, the workers panel and the queue, from one /v1/overview read every REFRESH_MS.
"use strict";

function jobRow({ progress: p, activity: a }, serverTs) {
  const done = percent(p.tokens_done, p.tokens_total);
  const failed = percent(p.tokens_failed, p.tokens_total);
  const link = `/dashboard/jobs/${encodeURIComponent(p.job_id)}`;
  const red = (n) => (n ? "bad" : "");
  return `<tr data-job-id="${escapeHtml(p.job_id)}" data-state="${p.state}">
    <td class="left job"><a class="mono" href="${link}">${escapeHtml(p.job_id)}</a>
      <div class="sub"><span class="kind" data-field="kind">${p.kind}</span> ${clock(Date.parse(p.created_at) / 1000)}</div></td>
    <td class="left state-cell">${stateBadge(p.state)}${stalledFlag(a)}${pausedReason(p)}</td>
    <td>${done.toFixed(1)}%<br><span class="bar" title="${done.toFixed(1)}% committed, ${failed.toFixed(1)}% failed"><span class="failed" style="width:${failed}%"></span><span style="width:${done}%"></span></span>
      <div class="sub" data-field="tokens_done" data-value="${p.tokens_done}" title="${exact(p.tokens_done)} of ${exact(p.tokens_total)} tokens">${compact(p.tokens_done)} / ${compact(p.tokens_total)}</div></td>
    <td data-field="tokens_per_second">${rateCell(p, a)}</td>
    <td data-field="eta">${etaCell(p, serverTs)}<div class="sub" data-field="elapsed">${duration(p.elapsed_seconds)} elapsed</div></td>
    <td data-field="samples_done" data-value="${p.samples_done}" title="${exact(p.samples_done)} of ${exact(p.samples_total)} samples committed">${compact(p.samples_done)} / ${compact(p.samples_total)}
      <div class="sub ${red(p.samples_failed)}" data-field="samples_failed" data-value="${p.samples_failed}">${compact(p.samples_failed)} failed</div>
      <div class="sub ${p.samples_rejected ? "warn" : ""}" data-field="samples_rejected" data-value="${p.samples_rejected}">${compact(p.samples_rejected)} rejected</div></td>
    <td data-field="shards_committed" data-value="${p.shards_committed}">${compact(p.shards_committed)} / ${compact(p.shards_total)}
      <div class="sub ${red(p.shards_dead_lettered)}" data-field="shards_dead_lettered" data-value="${p.shards_dead_lettered}">${compact(p.shards_dead_lettered)} dead</div></td>
    <td data-field="bytes_stored" data-value="${p.bytes_stored}" title="${exact(p.bytes_stored)} bytes, ${exact(p.bytes_per_token)} bytes/token">${bytes(p.bytes_stored)}
      <div class="sub">of ${bytes(p.projected_total_bytes)}</div><div class="sub">${compact(p.bytes_per_token)} B/token</div></td>
    <td data-field="headroom">${headroomCell(p)}</td>
  </tr>`;
}

function workerRow(w, serverTs) {
  const status = w.alive ? "" : ' <span class="flag dead">silent</span>';
  const holding = w.holding.length
    ? w.holding
        .map(
          (h) => `<div><a class="mono" href="/dashboard/jobs/${encodeURIComponent(h.job_id)}">${escapeHtml(h.job_id)}</a>
          shard ${h.shard_index} <span class="muted">${h.task.replace("eagle3.", "")}, ${duration(serverTs - h.started_ts)}</span></div>`,
        )
        .join("")
    : '<span class="muted">idle</span>';
  return `<tr data-worker="${escapeHtml(w.name)}" data-alive="${w.alive}">
    <td class="left wrap mono">${escapeHtml(w.name)}${status}<div class="sub">${w.concurrency} slot${w.concurrency === 1 ? "" : "s"}, up ${duration(serverTs - w.started_ts)}</div></td>
    <td class="${w.alive ? "" : "bad"}">${duration(w.seconds_since_heartbeat)} ago</td>
    <td class="left wrap">${holding}</td></tr>`;
}

function queueCards(q) {
  const card = (label, value, field, cls = "") =>
    `<div class="card"><div class="label">${label}</div><div class="value ${cls}" data-field="${field}">${value}</div></div>`;
  return (
    card("waiting shards", exact(q.depth), "queue_depth") +
    card("oldest waiting", q.oldest_age_s === null ? "–" : duration(q.oldest_age_s), "queue_oldest") +
    card("running (unacked)", exact(q.in_flight), "queue_in_flight")
  );
}

async function refresh() {
  const overview = await api("/v1/overview");
  const alive = overview.workers.filter((w) => w.alive).length;
  document.getElementById("jobs").innerHTML = overview.jobs.length
    ? overview.jobs.map((j) => jobRow(j, overview.server_ts)).join("")
    : '<tr><td class="left muted" colspan="9">no job yet: submit one with <span class="mono">eagle3 submit DATA.jsonl</span></td></tr>';
  document.getElementById("job-count").textContent = `${overview.jobs.length}, stalled after ${duration(overview.stall_after_s)} without a commit`;
  document.getElementById("workers").innerHTML = overview.workers.length
    ? overview.workers.map((w) => workerRow(w, overview.server_ts)).join("")
    : '<tr><td class="left muted" colspan="3">no worker has reported</td></tr>';
  document.getElementById("worker-count").textContent = `${alive} live of ${overview.workers.length}`;
  document.getElementById("queue").innerHTML = queueCards(overview.queue);
}

poll(refresh);
