"""The run shell every command shares (``train``, ``sft``, ``eval``, ``math-grpo``,
``math-eval``): the loop with its progress bar and checkpoint cadence (``loop``), checkpoint
folders, manifests and resumes (``checkpoints``), the run folder, metrics and trackers
(``tracking``), and the curves of a run (``plot``). It knows nothing about robots or
language models: the embodied trainer (``rlinf_vla.pipelines``) and the reasoning trainer
(``rlinf_vla.reasoning``) supply what an iteration does."""
