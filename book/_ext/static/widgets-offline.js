// Loaded before RequireJS and the widget manager on pages with widgets
// (see book/_ext/book_assets.py). Two small adapters:
(function () {
  // 1. The widget manager is a RequireJS module whose files (its icon fonts)
  //    are found relative to RequireJS's baseUrl. Point that at _static/,
  //    where the build put them, instead of at the page's own folder.
  var here = document.currentScript.src;
  window.require = { baseUrl: here.slice(0, here.lastIndexOf("/") + 1) };

  // 2. It typesets widget labels with MathJax 2's MathJax.Hub.Queue, but the
  //    book loads MathJax 3. Answer that one call with MathJax 3's API.
  function queue(command) {
    var mathjax = window.MathJax;
    if (mathjax && mathjax.typesetPromise) {
      mathjax.typesetPromise([command[2]]);
    }
  }
  var config = (window.MathJax = window.MathJax || {});
  config.Hub = { Queue: queue };
  config.startup = config.startup || {};
  config.startup.ready = function () {
    window.MathJax.startup.defaultReady();
    window.MathJax.Hub = { Queue: queue };
  };
})();
