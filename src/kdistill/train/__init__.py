"""Training: the distillation recipe and its parts.

- recipe: `train(cfg, run_dir)`, setup -> train loop -> finish, read top to bottom;
- preflight: the checks before loading (specs, tokenizers, vocabularies, memory plan);
- loading: data, teacher cache, teachers and student;
- targets: the teacher's side of the loss (live, mixture, cache, cross-tokenizer) and its extra terms;
- step: `compute_loss`, `heldout_eval`, one optimizer step (accumulation, all-reduce, non-finite policy);
- resume / checkpoint: what a checkpoint holds and how a resumed run restores it; the atomic writer;
- optim: AdamW and the learning-rate schedule;  distributed: torchrun and FSDP2;
- evidence: manifest, metrics.jsonl, plots;  rundir: the run folder;  corpus: the stdlib corpus;
- signals: SIGTERM/SIGINT;  faults: the test fault hooks.
"""
