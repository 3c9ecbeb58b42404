"""The contract in backends/__init__.py is what both runtimes honour: every member a Protocol
names (method or attribute) exists on each real implementation, loaded from the tiny checkpoint."""

from __future__ import annotations

import pytest

from backends import contract as backends


def members(protocol: type) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")}
    return names | set(vars(protocol).get("__annotations__", {}))  # attributes: annotated, unassigned


def missing(protocol: type, implementation: object) -> set[str]:
    return {name for name in members(protocol) if not hasattr(implementation, name)}


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_each_runtime_has_every_member_of_the_contract(request, runtime):
    backend = request.getfixturevalue(f"{runtime}_backend")
    assert missing(backends.Backend, backend) == set()
    assert missing(backends.Adapters, backend.adapters) == set()
    assert missing(backends.Detokenizer, backend.detokenizer()) == set()
    assert missing(backends.Decoder, backend.decoder(1)) == set()
    grammar = backend.constraint("regex", "[ab]+")
    assert missing(backends.Grammar, grammar) == set()
    assert missing(backends.Constraint, grammar.matcher()) == set()


def test_the_members_read_from_a_protocol_are_its_methods_and_attributes():
    assert {"capacity", "adapter_slots", "logprobs", "add", "step", "remove"} <= members(backends.Decoder)
    assert {"directory", "default_name", "max_loaded", "available", "loaded", "get"} == members(backends.Adapters)
    assert missing(backends.Adapters, object()) == members(backends.Adapters)
