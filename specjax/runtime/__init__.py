"""What a decode is built from, under ``specjax.api``: the loaded model, its drafter, its tree, the checks it
must pass and its compiled executables (one module each)."""
