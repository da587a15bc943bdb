// Loaded on pages with widgets, after require.js and before the widget manager
// (see nb_ipywidgets_js in _config.yml). Written for this book.
(function () {
  // 1. The widget manager asks require.js where it lives and loads its fonts
  //    from there: point it at the copy the site serves, relative to this page.
  var root = document.documentElement.dataset.content_root || "./";
  require.config({ paths: { "@jupyter-widgets/html-manager/dist": root + "_static/html-manager" } });

  // 2. The widget manager typesets widget labels through MathJax 2's
  //    MathJax.Hub.Queue; the book uses MathJax 3. Provide that one call.
  var pending = [];
  function queue() {
    for (var i = 0; i < arguments.length; i++) {
      var job = arguments[i];
      if (!Array.isArray(job) || job[0] !== "Typeset" || !job[2]) continue;
      if (window.MathJax && window.MathJax.typesetPromise) {
        window.MathJax.typesetPromise([job[2]]);
      } else {
        pending.push(job[2]);
      }
    }
  }
  window.MathJax = window.MathJax || {};
  window.MathJax.Hub = { Queue: queue };
  var startup = (window.MathJax.startup = window.MathJax.startup || {});
  startup.ready = function () {
    window.MathJax.startup.defaultReady();
    window.MathJax.Hub = { Queue: queue };
    window.MathJax.startup.promise.then(function () {
      if (pending.length) window.MathJax.typesetPromise(pending.splice(0));
    });
  };
})();
