// Sizes the effort-mix bars from their data-share attribute (the CSP forbids inline styles).
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll(".bar[data-share]").forEach(function (el) {
    var share = parseFloat(el.getAttribute("data-share"));
    if (isFinite(share)) { el.style.width = Math.round(Math.max(0, Math.min(1, share)) * 120) + "px"; }
  });
});
