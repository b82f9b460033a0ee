// seqlib.notebook.interact's player: the controls of an ipywidgets.interact, drawn in plain HTML, that
// switch between outputs computed when the book was built. No kernel, no network, no libraries.
// The data (the <script type="application/json"> before this one) holds, per control, its name,
// description, kind ("range", "select", "checkbox") and value labels; the precomputed settings (a
// position per control); which output each setting shows; and the distinct outputs as HTML.
(function () {
  const root = document.currentScript.parentElement;
  const data = JSON.parse(root.querySelector(".seqlib-interact-data").textContent);
  if (!document.getElementById("seqlib-interact-style")) {
    const style = document.createElement("style");
    style.id = "seqlib-interact-style";
    style.textContent =
      ".seqlib-interact-controls{display:flex;flex-wrap:wrap;gap:.3em 1.5em;margin:.5em 0;font-size:.9em}" +
      ".seqlib-interact-controls label{display:flex;align-items:center;gap:.5em}" +
      ".seqlib-interact-controls output{min-width:3.5em;font-family:monospace}" +
      ".seqlib-interact-note{font-size:.8em;color:#666;margin:0 0 .5em}" +
      ".seqlib-interact-output img{max-width:100%}";
    document.head.appendChild(style);
  }
  const controls = document.createElement("div");
  controls.className = "seqlib-interact-controls";
  const output = document.createElement("div");
  output.className = "seqlib-interact-output";
  output.setAttribute("aria-live", "polite");
  let current = data.settings[0].slice();

  const inputs = data.controls.map((control, i) => {
    const label = document.createElement("label");
    const title = document.createElement("span");
    title.textContent = control.description;
    let input;
    if (control.kind === "select") {
      input = document.createElement("select");
      control.labels.forEach((text, k) => input.add(new Option(text, String(k))));
    } else {
      input = document.createElement("input");
      input.type = control.kind === "checkbox" ? "checkbox" : "range";
      if (input.type === "range") Object.assign(input, { min: 0, max: control.labels.length - 1, step: 1 });
    }
    input.name = control.name;
    const readout = document.createElement("output");
    input.addEventListener(control.kind === "range" ? "input" : "change", () => choose(i, position(i)));
    label.append(title, input);
    if (control.kind === "range") label.append(readout);
    controls.append(label);
    return { input, readout, control };
  });

  function position(i) {
    const { input, control } = inputs[i];
    if (control.kind === "checkbox") return control.labels.indexOf(input.checked ? "on" : "off");
    return Number(input.value);
  }

  // The computed setting that agrees with the control just moved and with most of the others.
  function choose(i, k) {
    let best = -1, agreeing = -1;
    data.settings.forEach((setting, j) => {
      if (setting[i] !== k) return;
      const same = setting.filter((p, m) => p === current[m]).length;
      if (same > agreeing) [best, agreeing] = [j, same];
    });
    if (best >= 0) show(best);
  }

  function show(j) {
    current = data.settings[j].slice();
    inputs.forEach(({ input, readout, control }, i) => {
      const k = current[i];
      if (control.kind === "checkbox") input.checked = control.labels[k] === "on";
      else input.value = String(k);
      readout.textContent = control.labels[k];
    });
    output.innerHTML = data.outputs[data.shows[j]];
    root.dataset.setting = String(j);
  }

  root.append(controls);
  if (!data.complete) {
    const note = document.createElement("p");
    note.className = "seqlib-interact-note";
    note.textContent = "Precomputed for " + data.settings.length + " settings: moving one control may move " +
      "the others to a computed setting. Run the notebook to try any combination.";
    root.append(note);
  }
  root.append(output);
  show(0);
})();
