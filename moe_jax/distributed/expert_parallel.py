"""Expert parallelism: how tokens reach the experts a device owns, inside `shard_map`.

An `EPImplementation` is built once per experts module (`ShardedExperts`, when the model is built) with the
device groups, and serves every call and trace after that. Called on the batch this device holds with GLOBAL
expert ids, it returns the weighted expert output for those tokens; each call hands it, as arguments, this
device's experts function bound to the call's weights (`experts_forward`) and the dispatch capacity in
force (`capacity`), so an implementation keeps no per-call state. Implementations are chosen by
`DistributedConfig.ep_implementation` from `EPImplementationInterface`, which users extend:

    class MyEP(EPImplementation):
        def __call__(self, hidden_states, top_k_index, top_k_weights, *, experts_forward, capacity=None):
            ...  # bring this device's experts the rows routed to them
            return experts_forward(tokens, local_expert_ids, weights)   # [T, H]

    EPImplementationInterface.register("my_ep", MyEP)

`__call__` may take any of the keywords `experts_forward`, `capacity` and `inference` (the MoE block's mode, for
implementations that pick a path per call, as `auto` does): it receives those it names. `adapter_index` ([T]
int32, each token's adapter, where several LoRA adapters adapt the experts) goes with the tokens, each row's to
`experts_forward(..., adapter_index=[rows])` (the registered ones carry it). The reference's form,
`__call__(self, hidden_states, top_k_index, top_k_weights)` calling `self.experts_forward(...)`, works too: such
a class is built again for each call being traced, with that call's experts as `experts_forward` (and the call's
capacity as its `capacity` option when it takes capacity options).

Registered:
    "all_to_all"  token dispatch: each TP rank of a batch sends a disjoint slice of its rows to the devices
                  owning their experts (`jax.lax.all_to_all` over the ep group), results come back the same
                  way, weighted on the sender, gathered over tp. Works for every layout (ep > tp too).
    "all_reduce"  every device of the ep group runs its own experts on the pairs of the shared batch routed
                  to them (compacted into a static buffer), then `psum`. Needs ep_size == tp_size.
    "auto"        all_reduce at inference when the ep group shares one batch, all_to_all otherwise.
    "deepgemm_megamoe"  DeepGEMM's fused kernel: CUDA/PyTorch only, raises here.

Dispatch in static shapes. Buffers hold a fixed number of rows set by the *capacity* of the call (see
`moe_jax.distributed.capacity`), so a layer's shapes never depend on the routing. Dropless (the default,
`capacity_factor=None`): the caller passes a capacity from the model's ladder (`CapacitySchedule`: 1.25, 1.5,
2, 3, 4, 6, ... up to ep, where nothing can overflow) with each call; a call whose busiest buffer overflowed
reports `dropped > 0` and the `required_capacity` that would have fitted, and the caller recomputes it
there. With `capacity_factor` set, pairs beyond `capacity_factor` x the balanced share are dropped on
purpose (their output is 0) and counted.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..ops.accumulation import accumulating_einsum, accumulation_dtype
from ..ops.permute import invert_permutation, take_rows
from .capacity import CapacitySchedule, DispatchStatistics, buffer_rows, required_capacity

# This device's experts, bound to their weights: (tokens [N, H], local expert ids [N, K], weights [N, K]) ->
# [N, H]; the sentinel id `num_local_experts` contributes nothing. One per activation kind in
# `moe_jax.ops.experts` (`swiglu_experts`, ...), bound by `ShardedExperts` for each call (and `adapter_index=` [N]).
ExpertsForward = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# The keywords an implementation's `__call__` may take, passed when it names them.
CALL_KEYWORDS = ("experts_forward", "capacity", "inference", "adapter_index")


def call_keywords(implementation_class: type) -> frozenset[str]:
    """Which of `CALL_KEYWORDS` the class's `__call__` takes (all of them with `**kwargs`)."""
    parameters = inspect.signature(implementation_class.__call__).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return frozenset(CALL_KEYWORDS)
    return frozenset(name for name in CALL_KEYWORDS if name in {parameter.name for parameter in parameters})


def _experts_outside_a_call(*_args, **_kwargs):
    raise RuntimeError(
        "This EP implementation was built without experts: `experts_forward` is passed to each call "
        "(`__call__(..., experts_forward=...)`), as `ShardedExperts` does; a reference-style implementation "
        "using `self.experts_forward` runs only inside a `ShardedExperts` call, which builds it with that "
        "call's experts.")


@dataclass(frozen=True)
class ExpertGroups:
    """What an implementation knows about the devices: mesh axes and sizes of the ep and tp groups.

    `all_axes` are every mesh axis (for agreements that must hold on all devices).
    """

    ep_axes: tuple[str, ...]
    tp_axes: tuple[str, ...]
    ep_size: int
    tp_size: int
    all_axes: tuple[str, ...]

    @property
    def shares_batch(self) -> bool:
        """True when the ep group is the tp group: all its devices hold the same batch."""
        return self.ep_size == self.tp_size


class EPImplementation:
    """Base class: built once per experts module; called inside `shard_map` on this device's batch.

    `__call__(hidden_states, top_k_index, top_k_weights, *, experts_forward, capacity, inference)` (any of
    the keywords; see the module docstring). `experts_forward` given to the constructor is what a
    reference-style `__call__` uses as `self.experts_forward` (`ShardedExperts` builds such a class per call
    with the call's experts); an implementation built once is given none and keeps no per-call state.
    """

    needs_shared_batch: ClassVar[bool] = False

    def __init__(self, experts_forward: ExpertsForward | None, num_local_experts: int, groups: ExpertGroups,
                 **options):
        self.experts_forward = experts_forward if experts_forward is not None else _experts_outside_a_call
        self.num_local_experts = num_local_experts
        self.groups = groups
        self.shares_batch = groups.shares_batch
        if self.needs_shared_batch and not self.shares_batch:
            raise ValueError(
                f"{type(self).__name__} needs every rank of the expert group to hold the same batch "
                f"(`ep_size == tp_size`)."
            )
        self.options = options

    def __call__(self, hidden_states, top_k_index, top_k_weights, *, experts_forward: ExpertsForward | None = None,
                 capacity: float | None = None, inference: bool = False):
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def ep_rank(self) -> jax.Array:
        """This device's position in its ep group (owns global experts [rank * L, (rank + 1) * L))."""
        return jax.lax.axis_index(self.groups.ep_axes)


def rows_adapter(adapter_index: jax.Array, token_of_row: jax.Array) -> jax.Array:
    """adapter_index [T], token_of_row [C] (>= T: none) -> each buffer row's adapter [C] int32, empty rows 0."""
    return jnp.take(adapter_index, token_of_row, mode="fill", fill_value=0).astype(jnp.int32)


def tp_row_slice(rows: int, tp_size: int) -> int:
    """Rows each TP rank takes from a shared batch of `rows` (torch.chunk: trailing slices may be short)."""
    return -(-rows // tp_size) if rows else 0


class CapacityBuffers:
    """Static per-device buffers sized from the routed pairs (shared by all_to_all and all_reduce).

    Options: `schedule` (the model's `CapacitySchedule`; default the one for this ep size): the ladder the
    `required_capacity` statistic names; `capacity` (float, default the ladder's largest, which never drops):
    the dropless capacity of a call that passes none; `capacity_factor` (float | None): when set, buffers
    of that size and overflow dropped on purpose.
    """

    accepts_capacity_options: ClassVar[bool] = True

    def _init_capacity(self, capacity, capacity_factor, schedule) -> None:
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for dropless dispatch).")
        self.schedule = schedule if schedule is not None else CapacitySchedule.for_ep(self.groups.ep_size)
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity={capacity} must be > 0.")
        self.capacity = self.schedule.largest if capacity is None else capacity
        self.capacity_factor = capacity_factor

    def buffer_rows(self, pairs: int, capacity: float | None = None) -> int:
        """Buffer rows (per peer, or per device for all_reduce) for `pairs` pairs held by one device, at the
        call's dropless `capacity` (None: `self.capacity`), or at `capacity_factor` when that is set."""
        dropless = self.capacity if capacity is None else capacity
        factor = dropless if self.capacity_factor is None else self.capacity_factor
        return buffer_rows(factor, pairs, self.groups.ep_size)

    def statistics(self, routed, kept, total_rows: int, busiest_rows, pairs: int) -> DispatchStatistics:
        """routed: pairs bound for this device's buffers; kept: those that fitted; total_rows: the rows of
        all its buffers; busiest_rows: the rows its fullest buffer needed."""
        return DispatchStatistics(
            dropped=(routed - kept).astype(jnp.int32),
            padded=(total_rows - kept).astype(jnp.int32),
            buffer_rows=jnp.asarray(total_rows // self.num_buffers, jnp.int32),
            required_capacity=required_capacity(busiest_rows, pairs, self.groups.ep_size,
                                                self.schedule.ladder),
        )


class AllToAllEP(CapacityBuffers, EPImplementation):
    """Token dispatch with `jax.lax.all_to_all` (see the module docstring for the capacity policy)."""

    num_buffers = property(lambda self: self.groups.ep_size)  # one buffer per peer

    def __init__(self, experts_forward, num_local_experts, groups, *, capacity=None, capacity_factor=None,
                 schedule=None, **options):
        super().__init__(experts_forward, num_local_experts, groups, **options)
        self._init_capacity(capacity, capacity_factor, schedule)

    def __call__(self, hidden_states, top_k_index, top_k_weights, *, experts_forward: ExpertsForward | None = None,
                 capacity: float | None = None, adapter_index: jax.Array | None = None):
        """hidden_states: [T, H]; top_k_index: [T, K] global ids; top_k_weights: [T, K] -> ([T, H], stats).
        experts_forward: this device's experts (None: `self.experts_forward`); capacity: the call's;
        adapter_index: [T] each token's adapter, sent with it to its experts (None: no adapter set)."""
        experts_forward = experts_forward or self.experts_forward
        groups = self.groups
        rows, top_k = top_k_index.shape
        slice_rows = tp_row_slice(rows, groups.tp_size)
        if slice_rows == 0:
            return jnp.zeros_like(hidden_states), DispatchStatistics.zeros()

        row_valid, hidden, index, weights, adapters = self._take_tp_slice(
            slice_rows, hidden_states, top_k_index, top_k_weights, adapter_index)
        pairs = slice_rows * top_k
        num_local = self.num_local_experts
        num_global = num_local * groups.ep_size
        # Pairs of padding rows sort behind every real pair and belong to no peer.
        pair_expert = jnp.where(jnp.repeat(row_valid, top_k), index.reshape(pairs), num_global)
        order = jnp.argsort(pair_expert, stable=True)
        sorted_expert = pair_expert[order]
        peer_counts = jnp.bincount(sorted_expert // num_local, length=groups.ep_size + 1)[: groups.ep_size]
        peer_starts = jnp.cumsum(peer_counts) - peer_counts

        peer_rows = self.buffer_rows(pairs, capacity)
        slot = jnp.arange(peer_rows)
        slot_valid = slot[None, :] < peer_counts[:, None]  # [ep, C]
        position = jnp.where(slot_valid, peer_starts[:, None] + slot[None, :], pairs)  # [ep, C]
        # slot -> pair and pair -> slot; out-of-range markers (pairs, ep * C) where nothing is held or sent.
        slot_pair = jnp.where(slot_valid, order[jnp.minimum(position, pairs - 1)], pairs).reshape(-1)
        sorted_peer = jnp.minimum(sorted_expert // num_local, groups.ep_size - 1)
        slot_in_peer = jnp.arange(pairs) - peer_starts[sorted_peer]
        sorted_slot = jnp.where((sorted_expert < num_global) & (slot_in_peer < peer_rows),
                                sorted_peer * peer_rows + slot_in_peer, groups.ep_size * peer_rows)
        pair_slot = sorted_slot[invert_permutation(order)]
        send_tokens = take_rows(hidden, jnp.where(slot_pair < pairs, slot_pair // top_k, slice_rows), pair_slot)
        local_id = jnp.where(slot_valid, sorted_expert[jnp.minimum(position, pairs - 1)] % num_local, num_local)
        received = jax.lax.all_to_all(send_tokens, groups.ep_axes, 0, 0, tiled=True)
        received_ids = jax.lax.all_to_all(local_id.reshape(-1), groups.ep_axes, 0, 0, tiled=True)
        if adapters is not None:   # each row's adapter goes where its token goes
            sent_adapters = rows_adapter(adapters, slot_pair // top_k)
            experts_forward = partial(experts_forward, adapter_index=jax.lax.all_to_all(
                sent_adapters, groups.ep_axes, 0, 0, tiled=True))
        expert_out = experts_forward(received, received_ids[:, None], jnp.ones((received.shape[0], 1), hidden.dtype))
        returned = jax.lax.all_to_all(expert_out, groups.ep_axes, 0, 0, tiled=True)
        # Pairs past the buffer were not sent (dropped): their rows read zeros.
        pair_output = take_rows(returned.astype(hidden.dtype), pair_slot, slot_pair)  # [pairs, H], (row, k) order
        # The combine: weighted sum over k in at least fp32, rounded once to the hidden dtype (before the tp
        # gather, so that moves hidden-dtype bytes).
        token_output = accumulating_einsum(
            "tkh,tk->th", pair_output.reshape(slice_rows, top_k, -1), weights).astype(hidden.dtype)
        output = self._gather_tp_slices(token_output, rows)

        sent = jnp.sum(jnp.minimum(peer_counts, peer_rows))
        statistics = self.statistics(jnp.sum(peer_counts), sent, groups.ep_size * peer_rows, jnp.max(peer_counts), pairs)
        return output, statistics

    def _take_tp_slice(self, slice_rows, *arrays):
        """TP rank t of a shared batch keeps rows [t * c, (t + 1) * c) of each array (padded; None stays None)."""
        groups = self.groups
        rows = arrays[0].shape[0]
        if groups.tp_size == 1:
            return jnp.ones((rows,), bool), *arrays
        padded_rows = slice_rows * groups.tp_size

        def take(array):
            if array is None:
                return None
            padded = jnp.pad(array, [(0, padded_rows - rows)] + [(0, 0)] * (array.ndim - 1))
            return jax.lax.dynamic_slice_in_dim(padded, start, slice_rows)

        start = jax.lax.axis_index(groups.tp_axes) * slice_rows
        row_valid = (start + jnp.arange(slice_rows)) < rows
        return row_valid, *(take(array) for array in arrays)

    def _gather_tp_slices(self, token_output, rows):
        if self.groups.tp_size == 1:
            return token_output
        # Invariant over tp: every rank of the pair holds the whole batch again (backward: each takes its slice).
        gathered = jax.lax.all_gather(token_output, self.groups.tp_axes, axis=0, tiled=True, to="invarying")
        return gathered[:rows]


class AllReduceEP(CapacityBuffers, EPImplementation):
    """Local experts on the shared batch, summed over the ep group (needs ep_size == tp_size).

    Each device compacts the (token, expert) pairs routed to its own experts into a buffer of
    `buffer_rows(T * K)` rows (about 1/ep of the pairs, see `CapacityBuffers`), runs its experts on those rows
    only, adds the weighted results back to their tokens and `psum`s over the ep group. No tokens move
    between devices and no host sync is needed.
    """

    needs_shared_batch = True
    num_buffers = 1

    def __init__(self, experts_forward, num_local_experts, groups, *, capacity=None, capacity_factor=None,
                 schedule=None, **options):
        super().__init__(experts_forward, num_local_experts, groups, **options)
        self._init_capacity(capacity, capacity_factor, schedule)

    def __call__(self, hidden_states, top_k_index, top_k_weights, *, experts_forward: ExpertsForward | None = None,
                 capacity: float | None = None, adapter_index: jax.Array | None = None):
        """hidden_states: [T, H]; top_k_index: [T, K] global; top_k_weights: [T, K] -> ([T, H], stats).
        experts_forward: this device's experts (None: `self.experts_forward`); capacity: the call's;
        adapter_index: [T] each token's adapter (None: no adapter set)."""
        experts_forward = experts_forward or self.experts_forward
        rows, top_k = top_k_index.shape
        pairs = rows * top_k
        if pairs == 0:
            return jnp.zeros_like(hidden_states), DispatchStatistics.zeros()
        num_local = self.num_local_experts
        index = top_k_index.reshape(pairs)
        mine = (index // num_local) == self.ep_rank()  # [S]
        slot_of_pair = jnp.cumsum(mine) - 1
        slots = self.buffer_rows(pairs, capacity)
        kept = mine & (slot_of_pair < slots)
        # pair -> slot (pairs not kept here hold the out-of-range marker `slots`)
        pair_slot = jnp.where(kept, slot_of_pair, slots)
        # slot -> pair (slots past the local pairs hold the out-of-range marker `pairs`)
        slot_pair = jnp.full((slots,), pairs, jnp.int32).at[pair_slot].set(
            jnp.arange(pairs, dtype=jnp.int32), mode="drop"
        )
        slot_valid = slot_pair < pairs
        pair = jnp.minimum(slot_pair, pairs - 1)
        slot_token = jnp.where(slot_valid, pair // top_k, rows)
        tokens = take_rows(hidden_states, slot_token, pair_slot)  # [C, H]
        if adapter_index is not None:
            experts_forward = partial(experts_forward, adapter_index=rows_adapter(adapter_index, slot_token))
        local_id = jnp.where(slot_valid, index[pair] % num_local, num_local)
        expert_out = experts_forward(tokens, local_id[:, None], jnp.ones((slots, 1), hidden_states.dtype))
        # The combine: routing weights applied and summed over k in at least fp32 (other devices' pairs read
        # zeros here), then over the ep group, rounded once to the hidden dtype at the end. One [T, H] gather per
        # choice k, added in k order: no [T * K, H] buffer (the batch is the whole ep group's).
        accumulate = accumulation_dtype(hidden_states.dtype, top_k_weights.dtype)
        expert_rows = expert_out.astype(accumulate)
        slot_of_choice = pair_slot.reshape(rows, top_k)
        output = jnp.zeros((rows, hidden_states.shape[-1]), accumulate)
        for choice in range(top_k):
            # slot -> the token whose choice `choice` it holds (out of range: another choice, or nothing)
            token_of_slot = jnp.where(slot_valid & (slot_pair % top_k == choice), slot_pair // top_k, rows)
            picked = take_rows(expert_rows, slot_of_choice[:, choice], token_of_slot)             # [T, H]
            output = output + picked * top_k_weights[:, choice, None].astype(accumulate)
        output = jax.lax.psum(output, self.groups.ep_axes).astype(hidden_states.dtype)
        local_pairs = jnp.sum(mine)
        return output, self.statistics(local_pairs, jnp.sum(kept), slots, local_pairs, pairs)


class AutoEP(EPImplementation):
    """all_reduce at inference when the ep group shares a batch; all_to_all otherwise (training always)."""

    accepts_capacity_options = True

    def __init__(self, experts_forward, num_local_experts, groups, **options):
        super().__init__(experts_forward, num_local_experts, groups, **options)
        self.all_to_all = AllToAllEP(experts_forward, num_local_experts, groups, **options)
        self.all_reduce = AllReduceEP(experts_forward, num_local_experts, groups, **options) if self.shares_batch else None

    def choose(self, inference: bool) -> EPImplementation:
        return self.all_reduce if (inference and self.all_reduce is not None) else self.all_to_all

    def __call__(self, hidden_states, top_k_index, top_k_weights, *, experts_forward: ExpertsForward | None = None,
                 capacity: float | None = None, inference: bool = False, adapter_index: jax.Array | None = None):
        return self.choose(inference)(hidden_states, top_k_index, top_k_weights, experts_forward=experts_forward,
                                      capacity=capacity, adapter_index=adapter_index)


class DeepGemmMegaMoeEP(EPImplementation):
    """The reference's DeepGEMM Mega MoE path. Its fused kernel is CUDA/PyTorch only: no JAX port exists."""

    needs_shared_batch = True

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            '`ep_implementation="deepgemm_megamoe"` runs DeepGEMM\'s Mega MoE kernel, which exists only for '
            'PyTorch on CUDA (SM90+); moe_jax has no JAX port of it. Use ep_implementation="all_to_all" '
            '(any layout) or "all_reduce" (ep_size == tp_size).'
        )


class EPImplementationInterface:
    """Registry of EP implementations by name, as the reference's (`GeneralInterface`).

    `EPImplementationInterface.register(name, cls)` adds a name for every instance (overwrites silently);
    an instance also accepts local `interface[name] = cls` overrides.
    """

    _global_mapping: ClassVar[dict[str, type[EPImplementation]]] = {}

    def __init__(self):
        self._local_mapping: dict[str, type[EPImplementation]] = {}

    @classmethod
    def register(cls, name: str, implementation: type[EPImplementation]) -> None:
        cls._global_mapping[name] = implementation

    def __getitem__(self, name: str) -> type[EPImplementation]:
        if name in self._local_mapping:
            return self._local_mapping[name]
        return self._global_mapping[name]

    def __setitem__(self, name: str, implementation: type[EPImplementation]) -> None:
        self._local_mapping[name] = implementation

    def __delitem__(self, name: str) -> None:
        del self._local_mapping[name]

    def __contains__(self, name: object) -> bool:
        return name in self._local_mapping or name in self._global_mapping

    def __iter__(self) -> Iterator[str]:
        return iter({**self._global_mapping, **self._local_mapping})

    def __len__(self) -> int:
        return len({**self._global_mapping, **self._local_mapping})

    def valid_keys(self) -> list[str]:
        return list(self)


for _name, _implementation in (
    ("auto", AutoEP),
    ("all_to_all", AllToAllEP),
    ("all_reduce", AllReduceEP),
    ("deepgemm_megamoe", DeepGemmMegaMoeEP),
):
    EPImplementationInterface.register(_name, _implementation)


def check_registered(name: str, implementations: EPImplementationInterface | None = None) -> None:
    """A ValueError listing the registered names unless `name` is one of them."""
    implementations = implementations if implementations is not None else EPImplementationInterface()
    if name not in implementations:
        raise ValueError(
            f"`ep_implementation={name!r}` names no registered implementation: use one of "
            f"{', '.join(repr(n) for n in implementations)}, or register an `EPImplementation` with "
            "`EPImplementationInterface.register`."
        )


def build_ep_implementation(
    name: str,
    experts_forward: ExpertsForward | None,
    num_local_experts: int,
    groups: ExpertGroups,
    interface: EPImplementationInterface | None = None,
    **options,
) -> EPImplementation:
    """Look `name` up and build the implementation (the reference's `install_forward` checks).
    experts_forward: None for an implementation that takes it per call (`call_keywords`)."""
    implementations = interface if interface is not None else EPImplementationInterface()
    check_registered(name, implementations)
    implementation_class = implementations[name]
    if not getattr(implementation_class, "accepts_capacity_options", False):
        options = {key: value for key, value in options.items()
                   if key not in ("capacity", "capacity_factor", "schedule")}
    return implementation_class(experts_forward, num_local_experts, groups, **options)
