"""Inside a trained model: what its heads do, read and changed through hooks.

A GPT's residual stream is a sum: the embeddings, then what every head and every MLP adds.
The modules read that sum and change it:

* `heads`: repeated sequences and each head's induction and previous-token scores, the
  loss on each copy, and what each head writes;
* `stream`: the residual stream as a sum of writes, and the logit lens;
* `interventions`: ablating heads (zero or mean), activation patching of positions and of
  single heads;
* `circuits`: a head's QK and OV circuits, composition between heads, and whether a head
  copies.

The small models trained where copying pays are a recipe: `minigpt.recipes.copiers`.
"""
