"""After pre-training: a base model taught to converse, to prefer, and to earn rewards.

* `chat`: a conversation as one sequence of tokens, and back;
* `tasks`, `rhymes`: instruction data with answers a program can check;
* `sft`: supervised fine-tuning on conversations; `dpo`: preference tuning;
* `rl`: learning from verifiable rewards (GRPO, rejection sampling);
* `evals`: benchmarks beyond the loss; `classify`: a classification head.

These modules import the core (`minigpt.model`, `minigpt.train`, ...), never the recipes.
"""
