"""`treeopsd view RUN_DIR`: a local web page over a run's rollout trees (docs/viewer.md).

    run_files.py     what a run directory holds: its config, store, learner records, tokenizer; one-line
                     errors for what is not a run
    summaries.py     per-tree list rows from a segment's columns (vectorized, no tree decoded)
    tree_index.py    the list: segments indexed newest first as they are needed, filters, sorting, pages
    learner_turns.py the learner's per-turn records (learner/turn_record.py), read by batch
    tree_detail.py   one tree as the page draws it: structure, credit (stored or recomputed), the student
    server.py        the HTTP server (FastAPI on uvicorn, loopback unless a token is set)
    export.py        the same page with its data in a folder that opens without a server
    static/          the page: index.html, view.js, view.css (no library, nothing fetched)

Read-only over the run: no lock is taken and nothing is written under RUN_DIR, so a training run writing
the store is never held up. May import configs, system and storage (tests/unit/test_import_rules.py).
"""
