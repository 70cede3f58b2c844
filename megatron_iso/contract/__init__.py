"""The Execution Contract: what runs, with which constants, under which claims.

Typical use at start-up of either side of the RL loop::

    from megatron_iso.contract import handshake
    from megatron_iso.settings import contract_for

    contract = contract_for(cfg)  # every registered implementation loaded, the config resolved
    handshake(contract)  # or handshake(contract, path=rendezvous_dir, role="rollout", expect=("trainer",))
"""

from megatron_iso.contract.build import ContractValidationError, build_contract
from megatron_iso.contract.canonical import CanonicalError, canonical_json, diff_paths, sha256_of
from megatron_iso.contract.handshake import ContractMismatchError, HandshakeResult, check_compatible, handshake
from megatron_iso.contract.loader import load_op_implementations
from megatron_iso.contract.lockfile import LockfileError, VerifyReport, make_lock, read_lock, verify_lock, write_lock
from megatron_iso.contract.schema import SCHEMA, Contract, ContractFormatError, Identities

__all__ = [
    "SCHEMA",
    "CanonicalError",
    "Contract",
    "ContractFormatError",
    "ContractMismatchError",
    "ContractValidationError",
    "HandshakeResult",
    "Identities",
    "LockfileError",
    "VerifyReport",
    "build_contract",
    "canonical_json",
    "check_compatible",
    "diff_paths",
    "handshake",
    "load_op_implementations",
    "make_lock",
    "read_lock",
    "sha256_of",
    "verify_lock",
    "write_lock",
]
