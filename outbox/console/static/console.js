// The overview's chart: delivered per minute and topic over the last hour (uPlot), refreshed
// with the page's live part, and only while the tab is visible.
(function () {
  const box = document.getElementById("chart");
  if (!box || !window.uPlot) return;
  const src = box.dataset.src;
  const every = (Number(box.dataset.refresh) || 5) * 1000;
  const colors = ["#2b59c3", "#1e7d32", "#b3261e", "#8e44ad", "#d35400", "#16a085", "#7f8c8d"];
  let plot = null;
  let topics = "";
  function draw(data) {
    const names = Object.keys(data.series).sort();
    const rows = [data.x].concat(names.map((n) => data.series[n]));
    if (plot && names.join("\u0000") === topics) { plot.setData(rows); return; }
    if (plot) plot.destroy();
    topics = names.join("\u0000");
    const series = [{}].concat(names.map((n, i) => ({ label: n, stroke: colors[i % colors.length], width: 2 })));
    plot = new uPlot({ width: Math.min(box.clientWidth || 900, 1200), height: 220, series: series,
                       axes: [{}, { label: "events / min" }] }, rows, box);
  }
  function load() {
    if (document.visibilityState !== "visible") return;
    fetch(src, { credentials: "same-origin" }).then((r) => r.json()).then(draw).catch(() => {});
  }
  load();
  setInterval(load, every);
  document.addEventListener("visibilitychange", load);
})();

// A checkbox that checks or clears every checkbox named by its data-check-all (a list's rows).
// Here, not in an onclick attribute: the console's Content-Security-Policy runs no inline script.
document.addEventListener("change", function (event) {
  const box = event.target;
  if (!(box instanceof HTMLInputElement) || !box.dataset.checkAll) return;
  for (const b of document.querySelectorAll("input[name='" + box.dataset.checkAll + "']")) b.checked = box.checked;
});

// The overview's live part refreshes only while the tab is visible. Here, not in an hx-trigger
// filter: htmx evaluates a filter as script, which the console's Content-Security-Policy refuses.
document.addEventListener("htmx:beforeRequest", function (event) {
  if (event.target.hasAttribute("data-visible-only") && document.visibilityState !== "visible") event.preventDefault();
});
