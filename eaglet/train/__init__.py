"""Drafter training: self-distilled data (regen.py), draft vocabulary (vocab.py), the EAGLE-3
training-time test (ttt.py), the training loop with resumable checkpoints (trainer.py), and the
`data`, `train-draft` and `eval-draft` commands (commands.py)."""
