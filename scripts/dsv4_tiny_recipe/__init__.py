"""The pieces of the `dsv4-tiny` recipe: the fixed choices, the corpus, the tokenizer, the target model, its
training, its evaluation, and the run record with the model card rendered from it.

Imported by `scripts/train_dsv4_tiny.py` (the target's stages) and `scripts/train_dspark_draft.py` (the draft's,
which reuses the corpus, tokenizer and record), as a sibling of those scripts: running a script puts `scripts/`
on `sys.path`."""
