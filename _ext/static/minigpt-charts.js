/* Draws the book's interactive figures (minigpt.charts.interactive_chart) with the site's own
 * vega, vega-lite and vega-embed (_static/vega/, from npm): no kernel, no network.
 *
 * Each figure is a div.minigpt-chart holding its Vega-Lite specification as JSON in a
 * script.minigpt-chart-spec. Once drawn, the div's data-chart-state is "drawn" ("error" if
 * vega-embed failed) and its view is div.minigptView; window.minigptCharts resolves when
 * every figure of the page is settled (tools/make_pdf.py and tests/book/test_site.py wait on it).
 */
(function () {
  "use strict";

  function draw(container) {
    const source = container.querySelector("script.minigpt-chart-spec");
    const target = container.querySelector(".minigpt-chart-view");
    try {
      const spec = JSON.parse(source.textContent);
      // SVG: sharp in print, and every drawn item is an element a reader can hover.
      const options = {actions: false, renderer: "svg", tooltip: {theme: "light"}};
      return vegaEmbed(target, spec, options).then(
        (result) => {
          container.minigptView = result.view;
          container.dataset.chartState = "drawn";
        },
        (error) => {
          container.dataset.chartState = "error";
          console.error("minigpt chart " + container.id + ": " + error);
        });
    } catch (error) {
      container.dataset.chartState = "error";
      console.error("minigpt chart " + container.id + ": " + error);
      return Promise.resolve();
    }
  }

  function drawAll() {
    const charts = Array.from(document.querySelectorAll("div.minigpt-chart"));
    window.minigptCharts = Promise.all(charts.map(draw));
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", drawAll);
  } else {
    drawAll();
  }
})();
