/* The playground: the book's models write in the reader's browser, offline.
 *
 * Each div.minigpt-playground becomes a form: a prompt, the model (the book model of GPT-2's
 * recipe, the modern recipe's, or the fine-tuned assistant in its chat format, which keeps
 * the conversation as minigpt.chat does), temperature, top-k, top-p and a seed. The models are the ONNX graphs minigpt.export writes
 * (_static/playground/); onnxruntime-web (_static/onnxruntime/, single-threaded WebAssembly)
 * runs them, each step reading one token after a key-value cache as minigpt.decoding.generate
 * does. Nothing is fetched until the reader first asks for text, and nothing comes
 * from another host. Text appears character by character in an aria-live region; the
 * attention of any layer and head over the text is drawn with the book's Vega-Lite heatmap
 * (minigpt.charts.attention_explorer, whose specification playground.json holds); its cells
 * can be chosen with the arrow keys, and a line under it reads out the weight.
 *
 * The tokenizer and the sampler below are written to match the package operation for
 * operation: CharTokenizer.encode_ordinary / decode (minigpt.tokenizer), apply_temperature,
 * top_k_filter, top_p_filter and next_token_distribution (minigpt.decoding), and the
 * inverse-CDF draw (minigpt.decoding.inverse_cdf). window.minigptPlayground exposes them,
 * and the model's forward pass, to tests/book/test_playground.py.
 */
(function () {
  "use strict";

  const STATIC = document.currentScript.src.replace(/[^/]*$/, "");  // .../_static/
  const MAX_NEW = 1000;
  // The room a conversation keeps for the assistant's answer, as `python -m minigpt chat`
  // keeps its --max-new-tokens (32): the Characters field (200 by default) caps how much is
  // written, but reserving all of it would forget the first exchange after a few questions.
  const CHAT_ROOM = 32;
  // Each model's first prompt: minigpt.export.PROMPTS (tests/book/test_playground.py checks).
  const FIRST_PROMPTS = {"book": "ROMEO:\nBut soft, what light",
                         "modern": "ROMEO:\nBut soft, what light",
                         "sft-0": "upper: storm"};

  // ------------------------------------------------------------------- the sampler
  // Logits come as float32 from the model and are reshaped in float64.

  function checkReal(name, value) {
    if (typeof value !== "number" || !Number.isFinite(value)) {
      throw new Error(name + " must be a finite number, got " + value);
    }
    return value;
  }

  // apply_temperature: z / tau, tau > 0.
  function applyTemperature(logits, temperature) {
    if (!(temperature > 0)) {
      throw new Error("temperature must be > 0 to rescale logits, got " + temperature +
                      "; temperature 0 means greedy decoding");
    }
    return logits.map((z) => z / temperature);
  }

  // Token ids sorted by logit, largest first; ties in id order.
  function order(logits) {
    return Array.from(logits.keys()).sort((a, b) => logits[b] - logits[a] || a - b);
  }

  // top_k_filter: keep the k largest logits (ties with the k-th kept), -inf elsewhere.
  function topKFilter(logits, k) {
    const V = logits.length;
    if (!Number.isInteger(k) || k < 1 || k > V) {
      throw new Error("top-k must be an integer in [1, V] = [1, " + V + "], got " + k);
    }
    const kthLargest = logits[order(logits)[k - 1]];
    return logits.map((z) => (z < kthLargest ? -Infinity : z));
  }

  function softmax(logits) {
    const max = Math.max(...logits);
    const e = logits.map((z) => Math.exp(z - max));  // exp(-inf) = 0
    const sum = e.reduce((a, b) => a + b, 0);
    return e.map((x) => x / sum);
  }

  // top_p_filter: keep a token while the mass of the more likely ones is below p.
  function topPFilter(logits, p) {
    if (!(p > 0 && p <= 1)) {
      throw new Error("top-p must lie in (0, 1], got " + p);
    }
    if (p === 1) {
      return logits.slice();
    }
    const sorted = order(logits);
    const probs = softmax(sorted.map((i) => logits[i]));
    const kept = logits.slice();
    let cumulative = 0;
    sorted.forEach((token, rank) => {
      cumulative += probs[rank];
      const massBefore = cumulative - probs[rank];
      if (massBefore >= p) {
        kept[token] = -Infinity;
      }
    });
    return kept;
  }

  function argmax(values) {
    let best = 0;
    values.forEach((v, i) => { if (v > values[best]) { best = i; } });
    return best;
  }

  // next_token_distribution: one-hot argmax if greedy (or tau = 0), else softmax of the
  // tempered logits after top-k, then top-p (null: no filter).
  function nextTokenDistribution(logits, settings) {
    const z = Float64Array.from(logits);
    const tau = checkReal("temperature", settings.temperature);
    if (settings.greedy || tau === 0) {
      const q = new Float64Array(z.length);
      q[argmax(z)] = 1;
      return q;
    }
    let shaped = applyTemperature(z, tau);
    if (settings.topK !== null && settings.topK !== undefined) {
      shaped = topKFilter(shaped, settings.topK);
    }
    if (settings.topP !== null && settings.topP !== undefined) {
      shaped = topPFilter(shaped, settings.topP);
    }
    return softmax(shaped);
  }

  // inverse_cdf: the first token whose cumulative probability exceeds u in [0, 1); the last
  // token of non-zero probability if rounding leaves the total at or below u.
  function inverseCdf(probs, u) {
    let cumulative = 0;
    let last = 0;
    for (let i = 0; i < probs.length; i++) {
      if (probs[i] > 0) {
        cumulative += probs[i];
        last = i;
        if (cumulative > u) {
          return i;
        }
      }
    }
    return last;
  }

  // A seeded generator of uniform draws in [0, 1): mulberry32, 32 bits a draw.
  function uniformGenerator(seed) {
    let state = seed >>> 0;
    return function () {
      state = (state + 0x6d2b79f5) >>> 0;
      let t = state;
      t = Math.imul(t ^ (t >>> 15), t | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  // ------------------------------------------------------------------- the tokenizer

  function tokenizer(model) {
    const stoi = new Map(model.vocab.slice(0, model.chars).map((c, i) => [c, i]));
    return {
      encode(text) {  // CharTokenizer.encode_ordinary
        const chars = Array.from(text);  // by code point, as Python counts
        return chars.map((c, pos) => {
          if (!stoi.has(c)) {
            const code = c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
            throw new Error("character " + JSON.stringify(c) + " (U+" + code +
                            ") at position " + pos + " is not in the vocabulary of " +
                            model.chars + " characters");
          }
          return stoi.get(c);
        });
      },
      decode(ids) {
        return ids.map((i) => model.vocab[i]).join("");
      },
    };
  }

  // The ids a prompt becomes (minigpt.export.prompt_ids): its characters, or for the
  // assistant the user's turn and <|assistant|> (minigpt.chat.prompt_ids).
  function promptIds(model, text) {
    return model.chat ? chatIds(model, [{role: "user", text}]) : checkedIds(model, text);
  }

  function checkedIds(model, text) {
    if (typeof text !== "string" || text.length === 0) {
      throw new Error("the prompt is empty: type at least one character");
    }
    return tokenizer(model).encode(text);
  }

  // minigpt.chat.prompt_ids: each turn as its role's token, its text and <|end|>, then
  // <|assistant|>, which asks for the answer.
  function chatIds(model, turns) {
    const ids = [];
    for (const turn of turns) {
      const text = turn.role === "user" ? checkedIds(model, turn.text)
        : tokenizer(model).encode(turn.text);
      ids.push(model.chat[turn.role], ...text, model.chat.end);
    }
    ids.push(model.chat.assistant);
    return ids;
  }

  // minigpt.chat.fit_context: the turns without as few of their oldest as needed for the
  // prompt to leave room tokens for the answer, starting with a user's turn; the last
  // message is kept alone even with less room if it leaves two tokens (a character and
  // the end of the turn).
  function fitContext(model, turns, room) {
    const T = model.context_length;
    for (let start = 0; start < turns.length; start++) {
      const kept = turns.slice(start);
      if (kept[0].role === "user" && chatIds(model, kept).length + room <= T) {
        return kept;
      }
    }
    const n = chatIds(model, turns.slice(-1)).length;
    if (n < T - 1) {
      return turns.slice(-1);
    }
    throw new Error("this message makes a prompt of " + n + " tokens; the model reads " + T +
                    ", and an answer needs room: write a shorter one");
  }

  // ------------------------------------------------------------------- loading

  function loadScript(src) {
    return new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = src;
      script.onload = resolve;
      script.onerror = () => reject(new Error("could not load " + src));
      document.head.appendChild(script);
    });
  }

  let manifest = null;
  let runtime = null;
  const sessions = new Map();

  function loadManifest() {
    if (!manifest) {
      manifest = fetch(STATIC + "playground/playground.json").then((r) => {
        if (!r.ok) { throw new Error("playground.json: HTTP " + r.status); }
        return r.json();
      });
    }
    return manifest;
  }

  function loadRuntime() {
    if (!runtime) {
      runtime = loadScript(STATIC + "onnxruntime/ort.wasm.min.js").then(() => {
        // One thread: a static host gives no cross-origin isolation, hence no shared memory.
        window.ort.env.wasm.numThreads = 1;
        window.ort.env.wasm.proxy = false;
        window.ort.env.wasm.wasmPaths = STATIC + "onnxruntime/";
        return window.ort;
      });
    }
    return runtime;
  }

  async function session(name) {
    if (!sessions.has(name)) {
      sessions.set(name, (async () => {
        const [info, ort] = await Promise.all([loadManifest(), loadRuntime()]);
        const model = info.models[name];
        if (!model) { throw new Error("no model named " + name); }
        const graph = await ort.InferenceSession.create(STATIC + "playground/" + model.file,
                                                        {executionProviders: ["wasm"]});
        return {name, model, graph, ort};
      })());
    }
    return sessions.get(name);
  }

  // The graph (minigpt.export.WithCache) on ids after a cache: past is the present of an
  // earlier call, or null for none. Flat logits (T, V), attention (L, H, T, P + T), and the
  // present, the cache with the T new positions, to pass to the next call.
  async function forward(loaded, ids, past) {
    const model = loaded.model;
    const input = new loaded.ort.Tensor("int64", BigInt64Array.from(ids, BigInt),
                                        [1, ids.length]);
    const cache = past || new loaded.ort.Tensor(
      "float32", new Float32Array(0), [model.n_layers, 2, 1, model.kv_heads, 0, model.d_head]);
    const out = await loaded.graph.run({ids: input, past: cache});
    return {logits: out.logits.data, attention: out.attention.data, present: out.present,
            T: ids.length, P: cache.dims[4], V: model.vocab.length};
  }

  // The logits of the token after seq, read as minigpt.decoding.generate reads them with a
  // key-value cache: only the tokens the cache lacks; when seq outgrows the context, the
  // window has slid, every kept token has a new position, and the last context_length
  // tokens are read afresh. cache = {past, length} is updated.
  async function nextLogits(loaded, seq, cache) {
    const T = loaded.model.context_length;
    if (seq.length > T) {
      cache.past = null;
      cache.length = 0;
    }
    const out = await forward(loaded, seq.slice(cache.length).slice(-T), cache.past);
    cache.past = out.present;
    cache.length = out.P + out.T;
    return out.logits.slice((out.T - 1) * out.V, out.T * out.V);
  }

  // Generate up to n tokens after prompt ids; onToken(id) after each; stops at the end of
  // the assistant's turn (any chat token), or when shouldStop() says so.
  async function generate(loaded, ids, n, settings, onToken, shouldStop) {
    const seq = ids.slice();
    const draw = uniformGenerator(settings.seed);
    // The assistant's answer ends at its first chat token (chat.answer_turn cuts it there).
    const chat = loaded.model.chat;
    const stops = chat ? [chat.user, chat.assistant, chat.end] : [];
    const cache = {past: null, length: 0};
    for (let step = 0; step < n && !(shouldStop && shouldStop()); step++) {
      const q = nextTokenDistribution(await nextLogits(loaded, seq, cache), settings);
      const greedy = settings.greedy || settings.temperature === 0;
      const next = greedy ? argmax(q) : inverseCdf(q, draw());
      if (stops.includes(next)) { break; }
      seq.push(next);
      if (onToken) { onToken(next); }
    }
    return seq;
  }

  // ------------------------------------------------------------------- the heatmap

  const VISIBLE = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"};
  const AXIS_LABELS = {"<|user|>": "U", "<|assistant|>": "A", "<|end|>": "E"};
  function displayToken(token) {  // minigpt.viz.display_token
    return token === "" ? "∅" : Array.from(token).map((c) => VISIBLE[c] || c).join("");
  }

  function loadVega() {
    if (window.vegaEmbed) { return Promise.resolve(); }
    return ["vega/vega.min.js", "vega/vega-lite.min.js", "vega/vega-embed.min.js"].reduce(
      (chain, file) => chain.then(() => loadScript(STATIC + file)), Promise.resolve());
  }

  // The book's heatmap specification with this text's weights: the same rows as
  // attention_explorer (thousandths, causal half) and selectors for every layer and head.
  function heatmapSpec(template, model, tokens, attention) {
    const spec = JSON.parse(JSON.stringify(template));
    const T = tokens.length;
    const L = model.n_layers;
    const H = model.n_heads;
    const rows = [];
    for (let layer = 0; layer < L; layer++) {
      for (let head = 0; head < H; head++) {
        for (let query = 0; query < T; query++) {
          const base = ((layer * H + head) * T + query) * T;
          const w = [];
          for (let key = 0; key <= query; key++) {
            w.push(Math.round(attention[base + key] * 1000));
          }
          rows.push({layer, head, query, w});
        }
      }
    }
    spec.datasets = {[spec.data.name]: rows};
    spec.width = spec.height = 11 * T;
    for (const param of spec.params) {
      if (param.name === "tokens") { param.value = tokens.map(displayToken); }
      if (param.name === "layer") {
        param.bind.options = [...Array(L).keys()];
        param.bind.labels = param.bind.options.map((i) => "layer " + i);
      }
      if (param.name === "head") {
        param.bind.options = [...Array(H).keys()];
        param.bind.labels = param.bind.options.map((i) => "head " + i);
      }
    }
    // On the axes a chat token is one bold red letter, which fits its cell (U, A, E); the
    // tooltip and the readout give its name.
    spec.params.push({name: "labels", value: tokens.map(
                       (token) => AXIS_LABELS[token] || displayToken(token))},
                     {name: "chatToken", value: tokens.map((token) => token in AXIS_LABELS)});
    for (const axis of [spec.encoding.x.axis, spec.encoding.y.axis]) {
      axis.labelExpr = "labels[datum.value]";
      axis.labelColor = {condition: {test: "chatToken[datum.value]", value: "#c0392b"},
                         value: "#000000"};
      axis.labelFontWeight = {condition: {test: "chatToken[datum.value]", value: "bold"},
                              value: "normal"};
    }
    // The cell chosen with the arrow keys is outlined as a hovered one is.
    spec.params.push({name: "focusQuery", value: -1}, {name: "focusKey", value: -1});
    const chosen = "datum.query === focusQuery && datum.key === focusKey";
    for (const [channel, value] of [["stroke", "#e4572e"], ["strokeWidth", 2]]) {
      const hovered = spec.encoding[channel].condition;
      spec.encoding[channel].condition = [hovered, {test: chosen, value}];
    }
    spec.description = "Attention weights of one head over the text just written";
    return spec;
  }

  // ------------------------------------------------------------------- the form

  // The conversation as the output shows it: each question after "you: ", each answer
  // after "→ ", and "→ " for the answer being written.
  function transcript(turns) {
    return turns.map((t) => (t.role === "user" ? "you: " + t.text + "\n→ " : t.text + "\n"))
      .join("");
  }

  let counter = 0;

  function element(tag, attributes, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes || {})) {
      if (key === "text") { node.textContent = value; } else { node.setAttribute(key, value); }
    }
    for (const child of children || []) { node.appendChild(child); }
    return node;
  }

  function field(id, label, control, hint) {
    control.id = id;
    const parts = [element("label", {for: id, text: label}), control];
    if (hint) {
      const hintId = id + "-hint";
      control.setAttribute("aria-describedby", hintId);
      parts.push(element("span", {id: hintId, class: "minigpt-playground-hint", text: hint}));
    }
    return element("div", {class: "minigpt-playground-field"}, parts);
  }

  function numberInput(attributes) {
    return element("input", Object.assign({type: "number", inputmode: "decimal"}, attributes));
  }

  // Read and check the settings; throws an Error that names the bad field.
  function readSettings(controls, model) {
    const number = (control, name) => {
      const text = control.value.trim();
      const value = Number(text);
      if (text === "" || !Number.isFinite(value)) {
        throw new Error(name + " must be a number, got " + JSON.stringify(control.value));
      }
      return value;
    };
    const temperature = number(controls.temperature, "temperature");
    if (temperature < 0) {
      throw new Error("temperature must be >= 0 (0 means greedy), got " + temperature);
    }
    const V = model.vocab.length;
    let topK = null;
    if (controls.topK.value.trim() !== "") {
      topK = number(controls.topK, "top-k");
      if (!Number.isInteger(topK) || topK < 1 || topK > V) {
        throw new Error("top-k must be a whole number from 1 to " + V + " (or empty for " +
                        "all), got " + controls.topK.value);
      }
    }
    const topP = number(controls.topP, "top-p");
    if (!(topP > 0 && topP <= 1)) {
      throw new Error("top-p must lie in (0, 1], got " + topP);
    }
    const seed = number(controls.seed, "seed");
    if (!Number.isInteger(seed) || seed < 0 || seed > 4294967295) {
      throw new Error("the seed must be a whole number from 0 to 4294967295, got " + seed);
    }
    const length = number(controls.length, "characters");
    if (!Number.isInteger(length) || length < 1 || length > MAX_NEW) {
      throw new Error("characters must be a whole number from 1 to " + MAX_NEW + ", got " +
                      length);
    }
    return {temperature, topK, topP: topP === 1 ? null : topP, seed, length, greedy: false};
  }

  function build(container) {
    const id = "minigpt-playground-" + (++counter);
    const preset = container.dataset;
    const controls = {
      prompt: element("textarea", {rows: "3", spellcheck: "false"}),
      model: element("select", {}),
      temperature: numberInput({min: "0", max: "5", step: "0.05",
                                value: preset.temperature || "0.8"}),
      topK: numberInput({min: "1", step: "1", value: preset.topK || ""}),
      topP: numberInput({min: "0.01", max: "1", step: "0.01", value: preset.topP || "1"}),
      seed: numberInput({min: "0", step: "1", value: preset.seed || "7"}),
      length: numberInput({min: "1", max: String(MAX_NEW), step: "1",
                           value: preset.length || "200"}),
    };
    controls.prompt.value = preset.prompt || FIRST_PROMPTS[preset.model || "book"];
    for (const [value, label] of [["book", "GPT-2 recipe (the book model)"],
                                  ["modern", "modern recipe"],
                                  ["sft-0", "assistant (chat format)"]]) {
      controls.model.appendChild(element("option", {value, text: label}));
    }
    controls.model.value = preset.model || "book";
    const write = element("button", {type: "submit", class: "btn btn-primary", text: "Write"});
    const stop = element("button", {type: "button", class: "btn btn-secondary", text: "Stop"});
    stop.disabled = true;
    // The assistant keeps the conversation: each question is asked after the earlier turns
    // (as `python -m minigpt chat` asks it), until the reader starts a new one.
    const restart = element("button", {type: "button", class: "btn btn-secondary",
                                       text: "New conversation"});
    let conversation = [];
    function newConversation() {
      conversation = [];
      restart.disabled = true;
      restart.hidden = controls.model.value !== "sft-0";
    }
    newConversation();
    restart.addEventListener("click", () => {
      newConversation();
      promptShown.textContent = "";
      written.textContent = "";
      heatmap.hidden = true;
      status.textContent = "a new conversation: the assistant has forgotten the last one.";
    });
    // A prompt left as a model's first prompt follows the model chosen (the assistant
    // answers questions; the others continue a speech); a new model starts a new conversation.
    controls.model.addEventListener("change", () => {
      if (Object.values(FIRST_PROMPTS).includes(controls.prompt.value)) {
        controls.prompt.value = FIRST_PROMPTS[controls.model.value];
      }
      newConversation();
    });
    // novalidate: the checks below name the field and the allowed range in words.
    const form = element("form", {class: "minigpt-playground-form", novalidate: "",
                                  "aria-label": "Write with a model"}, [
      field(id + "-prompt", "Prompt", controls.prompt,
            "the assistant answers a question such as 'upper: storm'"),
      element("div", {class: "minigpt-playground-row"}, [
        field(id + "-model", "Model", controls.model),
        field(id + "-temperature", "Temperature τ", controls.temperature, "0: greedy"),
        field(id + "-top-k", "Top-k", controls.topK, "empty: all"),
        field(id + "-top-p", "Top-p", controls.topP),
        field(id + "-seed", "Seed", controls.seed),
        field(id + "-length", "Characters", controls.length),
      ]),
      element("div", {class: "minigpt-playground-buttons"}, [write, stop, restart]),
    ]);
    const status = element("p", {class: "minigpt-playground-status", role: "status"});
    const error = element("p", {class: "minigpt-playground-error", role: "alert"});
    const promptShown = element("span", {class: "minigpt-playground-prompt"});
    const written = element("span", {class: "minigpt-playground-written"});
    const output = element("pre", {class: "minigpt-playground-output", id: id + "-output",
                                   role: "log", "aria-live": "polite", "aria-label": "generated text",
                                   tabindex: "0"}, [promptShown, written]);
    const heatmapAlt = element("p", {class: "minigpt-playground-heatmap-alt",
                                     id: id + "-heatmap-alt"});
    const cells = element("div", {class: "minigpt-playground-view", tabindex: "0",
                                  role: "group", "aria-describedby": id + "-readout",
                                  "aria-label": "attention cells: arrow keys move between " +
                                                "them, the weight is read out below"});
    const readout = element("p", {class: "minigpt-playground-readout", id: id + "-readout",
                                  "aria-live": "polite"});
    const heatmap = element("div", {class: "minigpt-playground-heatmap", role: "figure",
                                    "aria-describedby": id + "-heatmap-alt"},
                            [heatmapAlt, cells, readout]);
    heatmap.hidden = true;
    const live = element("div", {class: "minigpt-playground-live"},
                         [form, status, error, output, heatmap]);
    container.appendChild(live);
    container.dataset.state = "ready";

    let stopping = false;
    stop.addEventListener("click", () => { stopping = true; });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      error.textContent = "";
      let loaded;
      let ids;
      let settings;
      let turns = null;  // the assistant's conversation, the new question last
      let forgotten = 0;
      try {
        status.textContent = "loading the model…";
        container.dataset.state = "loading";
        const started = performance.now();
        loaded = await session(controls.model.value);
        container.dataset.loadMs = String(Math.round(performance.now() - started));
        settings = readSettings(controls, loaded.model);
        if (loaded.model.chat) {
          const asked = [...conversation, {role: "user", text: controls.prompt.value}];
          turns = fitContext(loaded.model, asked, Math.min(settings.length, CHAT_ROOM));
          forgotten = asked.length - turns.length;
          ids = chatIds(loaded.model, turns);
        } else {
          ids = promptIds(loaded.model, controls.prompt.value);
        }
      } catch (problem) {
        error.textContent = problem.message;
        status.textContent = "";
        container.dataset.state = "error";
        return;
      }
      const tok = tokenizer(loaded.model);
      promptShown.textContent = loaded.model.chat ? transcript(turns) : controls.prompt.value;
      written.textContent = "";
      heatmap.hidden = true;
      write.disabled = true;
      stop.disabled = false;
      stopping = false;
      status.textContent = "writing…";
      container.dataset.state = "writing";
      const started = performance.now();
      let first = null;
      let count = 0;
      // An answer stops where the context is full (chat.greedy_replies); other text slides.
      const n = turns ? Math.min(settings.length, loaded.model.context_length - ids.length)
        : settings.length;
      try {
        const seq = await generate(loaded, ids, n, settings, (next) => {
          if (first === null) { first = performance.now() - started; }
          count += 1;
          written.textContent += tok.decode([next]);
        }, () => stopping);
        const seconds = (performance.now() - started) / 1000;
        container.dataset.firstCharMs = String(Math.round(first === null ? 0 : first));
        container.dataset.charsPerSecond = String(count / seconds);
        status.textContent = count + " characters in " + seconds.toFixed(1) + " s.";
        if (turns) {
          conversation = [...turns, {role: "assistant", text: tok.decode(seq.slice(ids.length))}];
          restart.disabled = false;
          if (forgotten) {
            status.textContent += " The conversation outgrew the context of " +
              loaded.model.context_length + " tokens: its first " + forgotten + " turn" +
              (forgotten === 1 ? " is" : "s are") + " forgotten.";
          }
        }
        await drawHeatmap(loaded, seq);
        container.dataset.state = "done";
      } catch (problem) {
        error.textContent = problem.message;
        container.dataset.state = "error";
      } finally {
        write.disabled = false;
        stop.disabled = true;
      }
    });

    // The keyboard's cell: arrow keys move the query (up, down) and the key (left, right)
    // within the causal half, Home and End go to the row's first and last key; the readout
    // says the weight, as the tooltip does on hover.
    const focus = {query: 0, key: 0, tokens: [], attention: null, model: null};
    function readCell() {
      const view = heatmap.minigptView;
      if (!view || !focus.attention) { return; }
      const T = focus.tokens.length;
      const layer = view.signal("layer");
      const head = view.signal("head");
      const weight = focus.attention[((layer * focus.model.n_heads + head) * T + focus.query) *
                                     T + focus.key];
      view.signal("focusQuery", focus.query).signal("focusKey", focus.key).runAsync();
      readout.textContent = "Layer " + layer + ", head " + head + ": query " + focus.query +
        " (" + displayToken(focus.tokens[focus.query]) + ") gives key " + focus.key + " (" +
        displayToken(focus.tokens[focus.key]) + ") weight " +
        (Math.round(weight * 1000) / 1000).toFixed(3) + ".";
    }
    cells.addEventListener("keydown", (event) => {
      const T = focus.tokens.length;
      const moves = {ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1],
                     ArrowRight: [0, 1], Home: [0, -T], End: [0, T]};
      // (the layer and head selectors inside keep their own arrow keys)
      if (event.target !== cells || !T || !(event.key in moves)) { return; }
      event.preventDefault();
      const [dq, dk] = moves[event.key];
      focus.query = Math.min(T - 1, Math.max(0, focus.query + dq));
      focus.key = Math.min(focus.query, Math.max(0, focus.key + dk));
      readCell();
    });

    async function drawHeatmap(loaded, seq) {
      const window_ = seq.slice(-loaded.model.context_length);
      const out = await forward(loaded, window_, null);
      const tokens = window_.map((i) => loaded.model.vocab[i]);
      const info = await loadManifest();
      await loadVega();
      const spec = heatmapSpec(info.heatmap, loaded.model, tokens, out.attention);
      heatmapAlt.textContent = "Heatmap of the attention weights of one head of the " +
        loaded.model.label + " over the last " + tokens.length + " tokens of the text: " +
        "rows are queries, columns keys, brighter is more weight" +
        (loaded.model.chat ? " (on the axes a red U, A and E are the chat tokens " +
                             "<|user|>, <|assistant|> and <|end|>)" : "") +
        ". Selectors choose the " +
        "layer and the head; hovering a cell, or moving to it with the arrow keys, shows " +
        "its weight.";
      heatmap.hidden = false;
      // Drawn on a canvas: an assistant's conversation of 200 tokens has 20,000 cells, which
      // as SVG elements took seconds to draw after every answer.
      const result = await window.vegaEmbed(cells, spec, {actions: false, renderer: "canvas",
                                                          tooltip: {theme: "light"}});
      heatmap.minigptView = result.view;
      Object.assign(focus, {query: tokens.length - 1, key: tokens.length - 1, tokens,
                            attention: out.attention, model: loaded.model});
      result.view.addSignalListener("layer", readCell);
      result.view.addSignalListener("head", readCell);
      readCell();
    }
  }

  window.minigptPlayground = {
    applyTemperature, topKFilter, topPFilter, nextTokenDistribution, inverseCdf,
    uniformGenerator, tokenizer, promptIds, chatIds, fitContext, session, forward,
    nextLogits, generate, heatmapSpec, loadManifest, FIRST_PROMPTS,
  };

  function buildAll() {
    document.querySelectorAll("div.minigpt-playground").forEach(build);
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", buildAll);
  } else {
    buildAll();
  }
})();
