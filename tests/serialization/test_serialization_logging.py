"""save and load say what they did through the ``branchyard`` logger (``-v`` on the CLI shows it)."""

import logging

import torch

import branchyard
from branchyard.examples import example_program
from branchyard.passes.cond_to_switch import cond_to_switch


def test_save_and_load_log_what_they_did(tmp_path, caplog):
    program = cond_to_switch(example_program("expert-dispatch", 4))
    path = tmp_path / "p.pt2"
    with caplog.at_level(logging.INFO, logger="branchyard"):
        branchyard.save(program, path)
        loaded = branchyard.load(path)
    messages = [r.getMessage() for r in caplog.records if r.name == "branchyard"]
    assert any(m.startswith(f"saved file '{path}' (1 switch(es)) in ") for m in messages), messages
    assert any(m.startswith(f"loaded file '{path}' (safe reader; 1 switch(es) restored) in ") for m in messages), messages
    x, idx = torch.randn(4, 16), torch.tensor(3)
    torch.testing.assert_close(loaded.module()(x, idx), program.module()(x, idx))
