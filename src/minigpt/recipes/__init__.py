"""The book's trained models: how each is made, cached and published.

Each recipe trains its models once, deterministically, with the core (`minigpt.train`) and,
for the assistants and the rewards runs, with `minigpt.posttrain`; the result is cached under
a key that hashes the recipe, the corpus, PyTorch and the code that trains it
(`pretrained.model_material`), so a chapter asks for a model and gets the same bits on
every x86-64 CPU:

* `pretrained`: the book's base models (GPT-2 layout, modern recipe, the draft);
* `assistant`: the modern model taught to answer (SFT) and to prefer (DPO);
* `rewards`: the runs of the chapter on learning from rewards;
* `copiers`: the small models trained where copying pays (the inside-the-model chapter);
* `runs`: the chapters' sweeps and ablations, each run kept like a model;
* `catalogue`: every model by name; `published`: the models fetched from the book's site,
  verified; `export`: the playground's ONNX models; `ledger`: where set-up's CPU time goes.
"""
