"""fastopt's differential tester (issue 25): semantic mutations of the real exports in
tests/fixtures/models (mutations.py) run through presets x targets x KV modes x quantization
modes (cases.py), judged in ONNX Runtime against the mutant (oracle.py), each run in a child
process that may crash (worker.py). Findings print their one-line case key; rerun one with

    python -m tests.difftest --case 'llama_ts_float32:token_shift:llm/ort/kv=standard/q=none:1'

and campaign with ``python -m tests.difftest --runs 500 --seed 7``.
tests/verify/test_difftest.py runs a
bounded sample by default and a long one under ``-m slow``."""
