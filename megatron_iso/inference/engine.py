"""The rollout engine: continuous batching over the trainer's own model object.

Colocated use holds a reference to the trainer's :class:`~megatron_iso.models.gpt.IsoGPTModel`
(same parameters, no copy); :meth:`RolloutEngine.from_hf_weights` builds one from HF-named
weights instead. Each :meth:`RolloutEngine.step` admits waiting requests (FIFO, while every state
cache can reserve their worst case), runs ONE packed forward (``IsoBatch`` case ``prefill`` when
new prompts join, else ``decode``; a decode row is a one-token prefill row, the same kernel), and
samples one token for every row:

- logits of the producing step -> :func:`~megatron_iso.inference.sampler.gumbel_tokens` (Gumbel-max on
  this rank's vocab shard, the noise keyed by (seed, request id, sample index, position) and the token id),
  or, for a row with top-k / top-p, ``parallel.vocab_scoring.log_softmax`` (full vocab gathered) ->
  :func:`~megatron_iso.inference.sampler.select_tokens` with one Philox uniform under the same key;
- the recorded logprob is ``parallel.vocab_scoring.token_logprobs`` on those logits and the drawn token: the
  trainer's function, so an iso-profile rollout logprob equals the trainer's recompute bit for bit.

Prefix sharing: with ``prefix_caching`` the prompt of a request is prefilled once and its ``n`` samples fork its
KV blocks; full prompt blocks are also kept for later requests with the same leading tokens. Contract rule
``prefix_cache flushed on weight_sync``: call :meth:`on_weights_updated` after every weight change.

Hybrid models (Gated DeltaNet layers) add a :class:`~megatron_iso.inference.gdn_slots.GDNSlotCache`
beside the paged KV cache (KV blocks then cover only the attention layers): one slot of conv and
recurrent state per running sequence, shared by the ``n`` samples after the prompt prefill (copy on
write). GDN state cannot be rebuilt from cached KV blocks, so cross-request prefix hits are off for
these models; the shared prompt prefill of a request's samples stays on.

Every TP rank runs the engine in lockstep on the same requests: scheduling is a function of the
requests alone and every rank draws the same tokens from the same gathered log-probabilities. Ranks with
different requests whose forwards share collectives (an EP group across data-parallel replicas) step together
in :meth:`RolloutEngine.generate`, a rank without work running idle forwards of padding rows
(:mod:`megatron_iso.inference.lockstep`).

Sequence parallelism (``parallel.sp``, TP > 1; the engine runs the trainer's model as it is built): each
rank holds ``T / TP`` of a step's packed rows between the layers, so ``T`` must divide by TP
(``models.batch.row_multiple``). A step whose tokens do not (an odd prompt, a decode step of 3 sequences at
TP 2) appends ``-T % TP`` padding rows, each a one-token sequence at position 0 whose key goes to the KV
cache's scratch block (``PagedKVCache.scratch_block``, reserved at construction) and whose GDN state goes to
the scratch slot (``GDNSlotCache.scratch``); their logits are dropped. They are the decode graphs' padding
rows (whose buckets are then multiples of TP, ``inference.cuda_graphs``), and, the correctness profile being
batch invariant, they change no other row's bits: tokens and logprobs equal TP 1's and TP 2 without SP's.
Why padding and not a forward without SP: SP is a property of the built modules (linears, embedding, MoE
dispatcher, GDN) with no per-call switch, and flipping it around every rollout call (Megatron-Core's
``set_model_to_sequence_parallel``) breaks the layout when one is missed; padding needs only the scratch block.
With ``EngineConfig.record_routing`` each token's MoE experts are kept beside its keys (``inference.routing_record``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

import megatron_iso.parallel.embedding  # noqa: F401  (registers the embedding op, as before the vocab split)
from megatron_iso.inference.cuda_graphs import DecodeGraphs, decode_graph_support
from megatron_iso.inference.draw import Drawer, DrawPlan, plan_draw
from megatron_iso.inference.engine_config import EngineConfig, EngineStats
from megatron_iso.inference.gdn_slots import GDNSlotCache
from megatron_iso.inference.kv_blocks import PagedKVCache
from megatron_iso.inference.lockstep import lockstep_agreement
from megatron_iso.inference.params import Request, RequestOutput, SampleOutput, SamplingParams
from megatron_iso.inference.rng import request_key
from megatron_iso.inference.routing_record import enable_routing_record, sequence_routing
from megatron_iso.inference.state import SequenceStateCache, StepState
from megatron_iso.models.batch import pack, row_multiple
from megatron_iso.models.gdn import gdn_layer_indices
from megatron_iso.models.moe_serving import refresh_expert_stacks
from megatron_iso.registry import Profile


@dataclass
class _Group:
    request: Request
    key: int
    output: RequestOutput
    total_len: int
    shared: bool


@dataclass
class _Seq:
    seq_id: int
    group: _Group
    sample: int | None  # None: a shared prompt prefill whose rows feed all n samples
    tokens: list[int]
    num_cached: int
    out: SampleOutput | None = None
    rows: list[int] = field(default_factory=list)


@dataclass
class _Drawn:
    """A step's draw, launched and not yet recorded: its rows ``(seq, sample index, token index)``, the
    device tokens (the next lookahead step's input ids) and the values to read back."""

    rows: list[tuple[_Seq, int, int]]
    params: list[SamplingParams]
    top_k: int
    tokens: torch.Tensor
    readback: torch.Tensor  # [R, 2 + 2k] float64: token, recorded logprob, top ids, top logprobs
    ready: torch.cuda.Event | None = None  # the pinned copy of ``readback`` is complete


class RolloutEngine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None) -> None:
        self.model = model  # the trainer's object: weights are shared (native MoE experts: a serving copy too)
        self.config = config or EngineConfig()
        mc = model.config
        if mc.pipeline_model_parallel_size > 1:  # a stage holds some layers: its KV cache would miss the others'
            raise ValueError(
                f"RolloutEngine runs a whole model; this one is a pipeline stage (pipeline_model_parallel_size="
                f"{mc.pipeline_model_parallel_size}); a pipelined trainer's rollout runs PP 1 (rl.rollout.LayoutRollout)"
            )
        self.profile = mc.iso_profile
        self.vocab_size = int(mc.vocab_size)
        limit = int(mc.max_sequence_length) or 1 << 62
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        tp = mc.tensor_model_parallel_size
        self.device = next(model.parameters()).device
        gdn_layers = set(gdn_layer_indices(mc))
        self.kv = PagedKVCache.from_budget(
            self.config.kv_cache_bytes,
            layers=[i for i in range(mc.num_layers) if i not in gdn_layers],
            block_size=self.config.block_size,
            kv_heads=mc.num_query_groups // tp,
            head_dim=mc.kv_channels,
            dtype=mc.params_dtype,
            device=self.device,
            prefix_caching=self.config.prefix_caching,
        )
        self.caches: list[SequenceStateCache] = [self.kv]
        self.gdn: GDNSlotCache | None = None
        if gdn_layers:
            self.gdn = GDNSlotCache.for_model(mc, self.config.max_num_seqs, device=self.device)
            self.caches.append(self.gdn)
        # Rows of every packed forward divide by it (sequence parallelism: module docstring); padding rows'
        # keys (also an idle lockstep step's) go to the scratch block, taken now, before any admission counts on it.
        self.row_multiple = row_multiple(mc)
        self.lockstep = lockstep_agreement(mc, self.device)  # None: this rank's forwards share no peer's collectives
        if self.row_multiple > 1 or self.lockstep is not None:
            try:
                self.kv.scratch_block()
            except ValueError as exc:
                raise ValueError(f"parallel.sp/ep: padding rows need a KV block of their own; {exc}") from exc
        if self.config.record_routing:  # each token's MoE experts, kept beside its keys (rl.routing_replay)
            enable_routing_record(self.kv, mc)
        self.weights_version = 0
        self.stats = EngineStats()
        self._waiting: deque[_Group] = deque()
        self._running: list[_Seq] = []
        self._inflight: _Drawn | None = None  # a lookahead decode step launched and not read yet
        self._errors: list[RequestOutput] = []
        self._ids = itertools.count()
        # (input_ids [1, T], IsoBatch) -> logits [T, V/tp]: the module itself, or decode graphs over it.
        self.drawer = Drawer(mc, self.profile)
        self.forward_fn: Callable[..., torch.Tensor] = model.forward_packed
        self.decode_graphs: DecodeGraphs | None = None
        self.decode_graphs_off: str | None = (
            decode_graph_support(model, paged_kv_reads=self.config.paged_kv_reads)
            if self.config.cuda_graphs
            else "EngineConfig.cuda_graphs=False"
        )
        if self.decode_graphs_off is None:
            try:
                self.enable_decode_graphs(capture=True)
            except ValueError as exc:  # a KV cache too small to spare the padding rows' scratch block
                self.decode_graphs_off = str(exc)

    # --- construction and weights ---------------------------------------------------------
    @classmethod
    def from_hf_weights(
        cls, model_config, hf_state_dict: Mapping[str, torch.Tensor], config: EngineConfig | None = None
    ) -> RolloutEngine:
        """A standalone engine: build this rank's model and load full HF-named weights into it."""
        from megatron_iso.models.gpt import build_model

        return cls(build_model(model_config, hf_state_dict).eval(), config)

    def load_hf_weights(self, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Weight sync from a full HF-named state dict, then the contract's invalidation."""
        from megatron_iso.models.weights import load_hf_state_dict

        load_hf_state_dict(self.model, hf_state_dict, self.model.config)
        self.on_weights_updated()

    def enable_decode_graphs(self, *, capture: bool) -> DecodeGraphs:
        """Serve decode steps from static per-bucket buffers, captured as CUDA graphs with ``capture``.

        The constructor calls it where :func:`decode_graph_support` allows; ``capture=False`` runs the
        same buffers and padding eagerly (how the CPU tests check them). It does not check that support
        itself: a caller forcing it takes that on. Padding rows write into the KV cache's scratch block;
        under sequence parallelism every bucket's row count is a multiple of TP."""
        if self.decode_graphs is None:
            width = min(-(-self.max_model_len // self.kv.block_size), self.kv.num_blocks)
            paged = self.profile == Profile.CORRECTNESS and self.config.paged_kv_reads
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv,
                width=width,
                max_rows=self.config.max_num_seqs,
                paged=paged,
                capture=capture,
                drawer=self.drawer,
                gdn=self.gdn,
                multiple=self.row_multiple,
            )
            self.decode_graphs_off = None
        return self.decode_graphs

    def decode_graphs_status(self) -> str:
        """One line for reports: decode steps replayed from CUDA graphs so far, or why graphs are off."""
        graphs = self.decode_graphs
        if graphs is None:
            return f"off: {self.decode_graphs_off}"
        line = f"{graphs.replays} of {self.stats.steps} steps replayed, {graphs.captures} captures"
        return line + (f"; {graphs.disabled}" if graphs.disabled else "")

    def on_weights_updated(self) -> None:
        """Contract rules ``{prefix_cache, kv_cache, recurrent_state} flushed on weight_sync`` (cached states hold the
        old weights' work), and the MoE experts' serving copies refreshed (performance profile, ``models.moe_serving``).
        Must be called with no sequence running (between :meth:`generate` calls)."""
        if self._running:
            raise RuntimeError(f"on_weights_updated with {len(self._running)} running sequences; finish them first")
        for cache in self.caches:
            cache.flush()
        refresh_expert_stacks(self.model)
        if self.decode_graphs is not None and self.decode_graphs.parameters_moved():
            self.decode_graphs.drop()  # weights loaded in place keep the graphs; new storage is re-captured
        self.weights_version += 1

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; an invalid one becomes an error result of the next step."""
        out = RequestOutput(request.request_id, list(request.prompt), weights_version=self.weights_version)
        try:
            key = request_key(request.request_id)
            request.params.validate(self.vocab_size)
            prompt = list(request.prompt)
            if not prompt:
                raise ValueError("prompt is empty; it needs at least one token id")
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
                raise ValueError(f"prompt holds token ids outside [0, {self.vocab_size})")
            if len(prompt) >= self.max_model_len:
                raise ValueError(
                    f"prompt of {len(prompt)} tokens leaves no room to generate: max_model_len={self.max_model_len}"
                )
        except (TypeError, ValueError) as exc:
            out.error = str(exc)
            self._errors.append(out)
            return
        p = request.params
        total = min(len(prompt) + p.max_new_tokens, self.max_model_len)
        shared = self.config.prefix_caching
        needs = {c.kind: (c.cost(len(prompt), total, p.n, shared, 0), c.capacity()) for c in self.caches}
        if any(need > cap for need, cap in needs.values()) or p.n > self.config.max_num_seqs:
            have = ", ".join(f"{kind} {need} of {cap}" for kind, (need, cap) in needs.items())
            out.error = (
                f"request needs more than the engine holds (units needed of capacity: {have}; {p.n} sequences): "
                f"kv_cache_bytes={self.config.kv_cache_bytes}, max_num_seqs={self.config.max_num_seqs}"
            )
            self._errors.append(out)
            return
        self._waiting.append(_Group(request, key, out, total, shared))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._errors or self._inflight)

    def generate(self, requests: Iterable[Request], *, progress: bool | None = None) -> list[RequestOutput]:
        """Run requests to completion; results in input order. The ranks of a lockstep group (``inference.lockstep``)
        call it together and return at the same step, a rank whose requests are done running idle forwards."""
        requests = list(requests)
        for r in requests:
            self.add_request(r)
        done: dict[int, RequestOutput] = {}
        show = self.config.progress if progress is None else progress
        bar = _progress(len(requests), show)
        while self.lockstep.any(self.has_unfinished()) if self.lockstep is not None else self.has_unfinished():
            before = self.stats.steps
            for out in self.step() if self.has_unfinished() else ():
                done[id(out)] = out
                bar.update(1)
            if self.lockstep is not None and self.stats.steps == before:
                self._idle_forward()  # one forward per rank per lockstep step
            bar.set_postfix_str(f"{self.stats.generated_tokens} tok")
        bar.close()
        by_id = {}
        for out in done.values():
            by_id.setdefault(out.request_id, []).append(out)
        return [by_id[r.request_id].pop(0) for r in requests]

    # --- one scheduler step -----------------------------------------------------------------
    def _admit(self) -> list[_Seq]:
        new: list[_Seq] = []
        rows, budget = len(self._running), self.config.max_prefill_tokens
        # Per cache: units the running sequences may still take, and those reserved by this step's admissions.
        reserved = [sum(c.remaining(s.seq_id, s.group.total_len) for s in self._running) for c in self.caches]
        while self._waiting:
            g = self._waiting[0]
            prompt, n = list(g.request.prompt), g.request.params.n
            if rows + n > self.config.max_num_seqs or (new and budget < len(prompt)):
                break
            hit = min(c.match_prefix(prompt) for c in self.caches) if g.shared else 0
            seqs = [self._new_seq(g, None if g.shared else i, prompt, hit) for i in range(1 if g.shared else n)]
            cost = [c.cost(len(prompt), g.total_len, n, g.shared, hit) for c in self.caches]
            # free_units after admit: a prefix hit may have pinned reclaimable blocks
            if any(c.free_units() - r < k for c, r, k in zip(self.caches, reserved, cost, strict=True)):
                for s in seqs:
                    for c in self.caches:
                        c.release(s.seq_id)
                break
            self._waiting.popleft()
            g.output.samples = [s.out for s in seqs if s.out is not None]
            reserved = [r + k for r, k in zip(reserved, cost, strict=True)]
            rows += n
            budget -= len(prompt) - hit
            self.stats.prefix_hit_tokens += hit * len(seqs)
            new += seqs
        return new

    def _new_seq(self, g: _Group, sample: int | None, prompt: list[int], hit: int) -> _Seq:
        s = _Seq(next(self._ids), g, sample, list(prompt), hit)
        for c in self.caches:
            c.admit(s.seq_id, prompt, hit)
        if sample is not None:
            s.out = SampleOutput(sample)
        return s

    def step(self) -> list[RequestOutput]:
        """Admit, run one packed forward, sample one token per sequence; the requests that finished.
        With lookahead, a decode step may be launched before the previous one's tokens are recorded."""
        finished, self._errors = self._errors, []
        if self._inflight is not None:
            previous, self._inflight = self._inflight, self._launch_ahead(self._inflight)
            finished += self._record(previous)  # overlaps the GPU's work on the step just launched
            if self._inflight is not None or not self.has_unfinished():
                return finished
        new = self._admit()
        batch_seqs = self._running + new
        if not batch_seqs:
            if self._waiting:  # add_request rejects what can never fit; this guards the invariant
                raise RuntimeError(
                    f"request {self._waiting[0].request.request_id!r} cannot be admitted into an idle engine"
                )
            return finished
        drawn = self._launch(batch_seqs, "prefill" if new else "decode", len(self._running))
        if not new and self.config.lookahead:
            self._inflight = drawn
            return finished
        return finished + self._record(drawn)

    def _launch(
        self, batch_seqs: list[_Seq], case: str, n_running: int, ids_from: torch.Tensor | None = None
    ) -> _Drawn:
        """One packed forward and its draw, without reading anything back. The first ``n_running`` sequences
        decode, the rest are new. ``ids_from``: the decode step's input ids, on the device (a lookahead step:
        the host holds placeholders for them)."""
        starts = [s.num_cached for s in batch_seqs]
        chunks = [s.tokens[s.num_cached :] for s in batch_seqs]
        counts = [len(c) for c in chunks]
        for s, a, c in zip(batch_seqs, starts, counts, strict=True):
            for cache in self.caches:
                cache.prepare_append(s.seq_id, a, c)
        # A decode step's draw is planned before its forward, so a decode graph can record it after the logits.
        planned = self._plan(batch_seqs)
        graphs = self.decode_graphs
        if case != "decode" or graphs is None or not graphs.serves(len(batch_seqs)):
            graphs = None  # this step runs a packed forward
        t0 = time.perf_counter()
        last_rows = None  # each sequence's last row in the logits (None: one row per sequence)
        if graphs is not None:
            # From the host lists straight into the bucket: no packed batch, no step view.
            tables = [self.kv.tables[s.seq_id] for s in batch_seqs]
            ids = ids_from if ids_from is not None else [c[0] for c in chunks]
            slots = None if self.gdn is None else [self.gdn.slot_of[s.seq_id] for s in batch_seqs]
            with torch.no_grad():
                logits = graphs.decode_step(starts, tables, ids, planned[1], slots)
        else:
            logits, last_rows = self._forward(batch_seqs, case, starts, chunks, counts, ids_from)
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.prefill_tokens += sum(counts[n_running:])
        self.stats.decode_tokens += sum(counts[:n_running])
        for s, c in zip(batch_seqs, counts, strict=True):
            s.num_cached += c
        if case == "decode":  # one row per sequence already (no gather copy)
            return self._draw(planned, logits, graphs.drawn() if graphs is not None else None)
        return self._draw(planned, logits[last_rows])

    def _forward(
        self,
        batch_seqs: list[_Seq],
        case: str,
        starts: list[int],
        chunks: list[list[int]],
        counts: list[int],
        ids_from: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed forward of the step (prefill, or a decode step no graph bucket serves): its logits and
        each sequence's last row in them. Under sequence parallelism the pack ends with padding rows (module
        docstring), one-token sequences at position 0 in the scratch block and slot; their logits are cut off."""
        n, real = len(chunks), sum(counts)
        pad = -real % self.row_multiple if n else self.row_multiple  # no sequence: an idle lockstep step
        seq_ids = [s.seq_id for s in batch_seqs]
        views = {self.kv.kind: self.kv.step_view(seq_ids, starts, counts, padding=pad)}
        views.update({c.kind: c.step_view(seq_ids, starts, counts) for c in self.caches if c is not self.kv})
        gdn = views.get(GDNSlotCache.kind)
        state = StepState(views, paged=self.config.paged_kv_reads)
        ids, batch = pack(
            [[0]] * (n + pad) if ids_from is not None else chunks + [[0]] * pad,
            start_positions=[*starts, *[0] * pad],
            case=case,
            kv_cache=state,
            slots=range(n + pad),  # the KV step view stages sequence i in row i
            gdn_cache=None if gdn is None else gdn.cache,
            # GDN state stays in each sequence's own slot; padding rows start fresh in the scratch slot.
            gdn_slots=None if gdn is None else [*gdn.slots, *[self.gdn.scratch] * pad],
            device=self.device,
        )
        if ids_from is not None:
            ids[0, :n].copy_(ids_from.reshape(n))
        with torch.no_grad():
            logits = self.forward_fn(ids, batch)
        state.finish()
        return logits[:real], batch.cu_seqlens_q[1 : n + 1].long() - 1

    def _idle_forward(self) -> None:
        """Padding rows only, nothing drawn: this rank's part in a lockstep step's collectives (``inference.lockstep``)."""
        t0 = time.perf_counter()
        self._forward([], "decode", [], [], [], None)
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.idle_steps += 1

    def _launch_ahead(self, previous: _Drawn) -> _Drawn | None:
        """The next decode step, launched before ``previous`` is recorded, when nothing waits for admission: its
        rows are the running samples with room for another token, its input ids ``previous``'s device tokens."""
        if self._waiting or any(s.sample is None for s in self._running):
            return None
        index = {id(s): r for r, (s, _, _) in enumerate(previous.rows)}
        seqs = [s for s in self._running if s.out.finish_reason is None and self._has_room(s) and id(s) in index]
        if not seqs:
            return None
        rows = [index[id(s)] for s in seqs]
        if rows == list(range(len(rows))):
            ids = previous.tokens[: len(rows)]
        else:
            ids = previous.tokens.index_select(0, torch.tensor(rows).to(self.device, non_blocking=True))
        return self._launch(seqs, "decode", len(seqs), ids_from=ids)

    def _has_room(self, s: _Seq) -> bool:
        """Whether sample ``s`` may take another token (counting the ones drawn and not recorded yet)."""
        drawn, p = len(s.tokens) - len(s.group.request.prompt), s.group.request.params
        return drawn < p.max_new_tokens and len(s.tokens) < self.max_model_len

    def _record(self, drawn: _Drawn) -> list[RequestOutput]:
        """Read a launched step's draw back and record it: tokens and logprobs into the outputs, finish
        reasons, forks of shared prefills, finished samples released; the requests that finished."""
        recorded = self._read_into_outputs(drawn)
        stepped = list({id(s): s for s, _, _ in drawn.rows}.values())
        running = []
        for s in stepped:
            if s.sample is None:
                running += self._fork(s)
            elif s.out.finish_reason is None:
                running.append(s)
            elif s.seq_id in self.kv.lengths:
                self._release(s)
        # Running samples not in this step (a lookahead step launched after it holds them) keep their place.
        in_step = {id(s) for s in stepped}
        self._running = [s for s in self._running if id(s) not in in_step and s.out.finish_reason is None] + running
        live = {id(s.group) for s in self._running}
        # A request is reported once: by the step that recorded its last token. (A lookahead step's unfinished
        # rows belong to running samples, so their requests are live.)
        return [g.output for g in recorded if id(g) not in live]

    def _fork(self, leader: _Seq) -> list[_Seq]:
        """The shared prompt prefill's n samples, each continuing from its blocks."""
        g = leader.group
        prompt = leader.tokens[: len(g.request.prompt)]
        for c in self.caches:
            c.commit_prefix(leader.seq_id, prompt)
        children = []
        for i, row_tokens in enumerate(leader.rows):
            child = _Seq(next(self._ids), g, i, list(prompt), leader.num_cached, out=g.output.samples[i])
            for c in self.caches:
                c.fork(leader.seq_id, child.seq_id)
            child.tokens.append(row_tokens)
            if child.out.finish_reason is None:
                children.append(child)
            else:
                self._release(child)
        for c in self.caches:
            c.release(leader.seq_id)
        return children

    def _release(self, s: _Seq) -> None:
        if self.kv.routes is not None and s.out is not None:  # every position but the last token ran a forward
            s.out.routing = sequence_routing(self.kv, s.seq_id, len(s.group.request.prompt) + len(s.out.tokens) - 1)
        for c in self.caches:
            c.release(s.seq_id)

    # --- sampling ---------------------------------------------------------------------------
    def _plan(self, seqs: list[_Seq]) -> tuple[list[tuple[_Seq, int]], DrawPlan]:
        """The step's sampling rows, ``(seq, sample index)`` each, and their draw plan; a shared prefill's
        logits row serves its n samples."""
        src, meta = [], []  # logits row, (seq, sample index) per sampling row
        for j, s in enumerate(seqs):
            if s.sample is None:
                g = s.group
                if not g.output.samples:
                    g.output.samples = [SampleOutput(i) for i in range(g.request.params.n)]
                for i in range(g.request.params.n):
                    src.append(j)
                    meta.append((s, i))
            else:
                src.append(j)
                meta.append((s, s.sample))
        params = [s.group.request.params for s, _ in meta]
        counters = [(p.seed, s.group.key, i, len(s.tokens)) for (s, i), p in zip(meta, params, strict=True)]
        return meta, plan_draw(src, params, counters, self.device)

    def _draw(
        self,
        planned: tuple[list[tuple[_Seq, int]], DrawPlan],
        logits: torch.Tensor,
        drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> _Drawn:
        """One token per sampling row, drawn on the device (``drawn``: a decode graph's draw) and queued for
        reading back; a sample's token gets its place in ``tokens`` now (a placeholder until recorded)."""
        meta, plan = planned
        k = plan.top_k_logprobs
        with torch.no_grad():
            tokens, recorded, top = self.drawer.draw(plan, logits, None if drawn is None else drawn[:2])
        # One device-to-host read for all of it, top logprobs included (were 2 reads per row that
        # asked for them): float64 holds the ids and the fp32 logprobs exactly.
        if drawn is not None and plan.graph_drawable:
            readback = drawn[2]  # the graph's own draw, laid out so inside the graph
        else:
            parts = [tokens.double().unsqueeze(-1), recorded.double().unsqueeze(-1)]
            if top is not None:
                parts += [top[0].double(), top[1].double()]
            readback = torch.cat(parts, dim=-1)
        ready = None
        if readback.is_cuda:  # copied as soon as the draw is done, read when recorded
            host = torch.empty(readback.shape, dtype=readback.dtype, pin_memory=True)
            readback, ready = host.copy_(readback, non_blocking=True), torch.cuda.Event()
            ready.record()
        rows = []
        for s, i in meta:
            if s.sample is None:
                rows.append((s, i, -1))
            else:
                rows.append((s, i, len(s.tokens)))
                s.tokens.append(-1)
        return _Drawn(rows, plan.params, k, tokens, readback, ready)

    def _read_into_outputs(self, drawn: _Drawn) -> list[_Group]:
        """Record the step's tokens; the requests that got one (rows past a sample's stop token are dropped)."""
        groups: dict[int, _Group] = {}
        if drawn.ready is not None:
            drawn.ready.synchronize()
        rows_l = drawn.readback.tolist()
        k = drawn.top_k
        for r, ((s, i, at), p) in enumerate(zip(drawn.rows, drawn.params, strict=True)):
            out = s.group.output.samples[i]
            if out.finish_reason is not None:  # a lookahead row past the sample's stop token: dropped
                continue
            token = int(rows_l[r][0])
            groups[id(s.group)] = s.group
            out.tokens.append(token)
            out.logprobs.append(rows_l[r][1])
            if p.top_logprobs:
                ids = [int(t) for t in rows_l[r][2 : 2 + p.top_logprobs]]
                vals = rows_l[r][2 + k : 2 + k + p.top_logprobs]
                out.top_logprobs = (out.top_logprobs or []) + [list(zip(ids, vals, strict=True))]
            self.stats.generated_tokens += 1
            out.finish_reason = p.finish_reason(out.tokens, len(s.group.request.prompt), self.max_model_len)
            if s.sample is None:
                s.rows.append(token)
            else:
                s.tokens[at] = token
                if out.finish_reason is not None:
                    del s.tokens[at + 1 :]  # placeholders of lookahead rows that will be dropped
        return list(groups.values())


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, show: bool):
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit="req")
