"""The contracts every layer reads: the trial spec (``spec.py``, one YAML per candidate) and the trial's
outputs (``result.py``: metrics.jsonl and result.json field names, statuses, failure reasons). Pure
Python (OmegaConf and dataclasses): nothing here imports torch or the trial engine."""
