"""Measuring one cell: prepare its state, time the request, check where the hits came from, record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pytest_kvoffload.core.vllm_releases import DEFAULT
from pytest_kvoffload.serve.backend import Backend
from pytest_kvoffload.measure.cells import Cell, Expectation, expectation
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.serve.client import (Endpoint, RequestResult, attach_sources, measure, poll_metrics,
                                           stream_completion)
from pytest_kvoffload.serve.metrics import Snapshot
from pytest_kvoffload.measure.prompts import Prompt, make_prompt
from pytest_kvoffload.measure.context import Recorder
from pytest_kvoffload.measure.output_check import TIE_CANDIDATES, OutputCheck, compare_outputs


# Greedy tokens compared with a recompute in one round of every hit cell: wrong KV changes them (on a model
# whose weights make attention matter, serve/weights.py), while TTFT stays the time to the first one.
OUTPUT_TOKENS = 8
# The longest wait for a tier's stores to settle before its hit (Backend.tier_settled). LMCache's server
# completed the 8 MiB store of a 2,048-token prompt within a request's time, so 10 s leaves room for a slow
# drive; past it the hit is measured anyway and its load proof says where it came from.
SETTLE_S = 10.0


def recompute(endpoint: Endpoint, tokens: list[int], salt: str, max_tokens: int = OUTPUT_TOKENS) -> RequestResult:
    """The prompt under a fresh cache_salt, which no engine or tier cache may answer, with the likeliest
    tokens' logprobs at each output position (measure/output_check.py compares a hit's with them)."""
    return stream_completion(endpoint, tokens, max_tokens, cache_salt=salt, logprobs=TIE_CANDIDATES)


def continuation(endpoint: Endpoint, prompt: list[int]) -> Callable[[list[int]], RequestResult]:
    """The output check's second hit past a near-tie: the prompt plus the recompute's tokens up to it."""
    return lambda done: stream_completion(endpoint, [*prompt, *done], OUTPUT_TOKENS - len(done),
                                          logprobs=TIE_CANDIDATES)


@dataclass
class CellOutcome:
    cell: Cell
    backend: str
    results: list[RequestResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ttfts(self) -> list[float]:
        return [r.client_ttft_s for r in self.results]


def place_in_tier_only(endpoint: Endpoint, backend: Backend, tokens: list[int],
                       first: Callable[[list[int]], RequestResult] | None = None) -> list[RequestResult]:
    """Leave `tokens`' prefix in the backend's tier and nowhere above it; returns the priming requests.
    `first` makes the first of them (a CellRunner's prime that doubles as a cold request or a reference)."""
    return leave_in_tier_only(endpoint, backend, lambda i: first(tokens) if first is not None and not i
                              else measure(endpoint, tokens))


def leave_in_tier_only(endpoint: Endpoint, backend: Backend, prime: Callable[[int], object]) -> list:
    """`prime(i)` as often as the backend's tier needs to see a prefix to keep it, then the engine's cache
    (and, where the backend says so, the tier above its files) emptied: what the primes computed is then in
    the tier and nowhere above it. Returns what each prime returned (a cell's requests, a trace's pass)."""
    results = []
    for i in range(backend.prime_requests):
        if i:
            # A tier that stores a block only on its second lookup must see the prefix computed again.
            endpoint.reset_prefix_cache(external=False)
        results.append(prime(i))
    endpoint.reset_prefix_cache(external=backend.evict_connector)
    if backend.evict_connector:
        # vLLM holds promotions from the file tier until the reset is flushed by a step: run one.
        stream_completion(endpoint, [1 + i for i in range(8)])
    if backend.tier_settled is not None:
        wait_until_settled(endpoint, backend.tier_settled)
    return results


def wait_until_settled(endpoint: Endpoint, settled: Callable[[dict], bool], deadline_s: float = SETTLE_S) -> bool:
    """Until `settled` holds of the server's counters, `deadline_s` at most; whether it did. Past the deadline
    the hit is measured all the same, and its load_proof says where it was served from."""
    return poll_metrics(endpoint, lambda after: settled(after.extra), deadline_s, every_s=0.02)[1]


# How a tier hit with no load proof was verified (record["verified_by"]; record/report.py names it).
SCHEDULER_ONLY = "scheduler only"


class CellRunner:
    """Runs the rounds of one cell; `setup`, `target` and `teardown` are shaped for benchmark.pedantic, so
    pytest-benchmark times only `target` (one streamed request; with max_tokens=1 its time is TTFT).

    A hit cell whose prompt is all prefix (fraction 1) primes with the prompt itself: that prime is a
    computation no cache answered (checked), so it is the output check's reference instead of another
    recompute. With `cold_prime` it is also recorded as a cold measurement of the same prompt (`colds`), so
    one prefill gives both the cold time and the tier's content: the admission suite's paired rounds."""

    def __init__(self, recorder: Recorder, backend: Backend, endpoint: Endpoint, cell: Cell,
                 first_round: int = 0, purpose: str = "measure", check_output: bool = True,
                 cold_prime: bool = False, paired_engine: bool = False, reuse: tuple[str, int] | None = None) -> None:
        if cold_prime and (cell.state is State.COLD or cell.fraction != 1.0):
            raise ValueError(f"cold_prime needs a hit cell whose prompt is all prefix, not {cell.id}")
        if reuse and (cell.state is not State.TIER_HIT or cell.fraction != 1.0 or cold_prime):
            raise ValueError(f"a round without its prime needs a tier-hit cell whose prompt is all prefix, not {cell.id}")
        self.recorder = recorder
        self.backend = backend
        self.endpoint = endpoint
        self.cell = cell
        self.outcome = CellOutcome(cell, backend.name)
        # "measure" rounds make the run's cells; others (a suite's probes) are recorded but kept out of them.
        self.purpose = purpose
        # Whether this runner's first round compares its output with a recompute (a caller running a cell
        # one round per runner asks for it once).
        self.check_output = check_output
        # Rounds number the prompts: a runner that continues a cell (first_round > 0) gets fresh ones.
        self._round = first_round
        self._first_round = first_round
        self._prompt: Prompt | None = None
        self._before: Snapshot | None = None
        self._pending: RequestResult | None = None
        # A buffered disk tier's page-cache state before this round's hit (Recorder.before_tier_read).
        self._tier_read: dict | None = None
        self.cold_prime = cold_prime
        # A tier-hit cell's rounds each followed by an engine hit of the same prefix on the same server: the
        # tier's limit, paired round by round (analysis/tier_limit.py).
        self.paired_engine = paired_engine and cell.state is State.TIER_HIT
        # (purpose, round): every round's prompt is the one an earlier runner of this cell (that purpose, that
        # round) left in the tier; a round then only empties the caches above the tier, as a prime's end does.
        self.reuse = reuse
        self.colds = CellOutcome(Cell(cell.length, 0.0, State.COLD), backend.name)
        # This round's prime, where it computed the whole prompt with no cache: the output check's reference.
        self._reference: RequestResult | None = None

    def prompt(self, variant: str) -> Prompt:
        s = self.recorder
        fraction = self.cell.fraction if self.cell.state is not State.COLD else 0.0
        # The purpose is part of the key: a suite's probes must never warm the cells measured after them.
        purpose, round_ = self.reuse or (self.purpose, self._round)
        salt = f"{s.salt}|{self.backend.name}|{purpose}|{self.cell.state.value}|round{round_}"
        return make_prompt(self.cell.length, fraction, seed=s.settings.random_seed, salt=salt, variant=variant,
                           vocab_size=s.settings.model.vocab_size)

    def setup(self):
        self._round += 1
        self._prompt = self.prompt("measure")
        self._reference = None
        if self.cell.state is not State.COLD:
            # The prime is the shared prefix alone: what the hit may find cached is its whole blocks (or storage
            # units) either way, and a prime of the whole length would compute a suffix no request reuses
            # (half the prime's prefill at fraction 0.5). A prompt with no shared token gets a whole prompt
            # of its own that shares nothing.
            primer = Prompt(self._prompt.prefix, ()) if self._prompt.prefix else self.prompt("prime")
            whole = not self._prompt.suffix and (self.cold_prime or self._checks_output())
            first = self._prime_whole if whole else None
            if self.cell.state is State.TIER_HIT and self.reuse:
                leave_in_tier_only(self.endpoint, self.backend, lambda i: None)
                self._tier_read = self.recorder.before_tier_read(self.backend.name)
            elif self.cell.state is State.TIER_HIT:
                for i, result in enumerate(place_in_tier_only(self.endpoint, self.backend, primer.tokens, first)):
                    if not (i == 0 and self.cold_prime):
                        self._record(result, purpose="prime")
                # A buffered disk tier could serve this hit from the page cache: not a disk read.
                self._tier_read = self.recorder.before_tier_read(self.backend.name)
            else:
                result = first(primer.tokens) if first else measure(self.endpoint, primer.tokens)
                if not self.cold_prime:
                    self._record(result, purpose="prime")
        self._before = self.endpoint.metrics()
        return (self._prompt.tokens,), {}

    def _prime_whole(self, tokens: list[int]) -> RequestResult:
        """The prime of a prompt that is all prefix: its output (and the likeliest tokens' logprobs) kept as
        the reference when nothing was cached; with cold_prime recorded as this round's cold measurement."""
        if self._checks_output():
            result = measure(self.endpoint, tokens, OUTPUT_TOKENS, logprobs=TIE_CANDIDATES)
        else:
            result = measure(self.endpoint, tokens)
        problem = Expectation(None, 0).check(result.cached_by_source)
        if problem is None and self._checks_output():
            self._reference = result
        if self.cold_prime:
            if problem:
                self.colds.failures.append(f"round {self._round}: {problem}")
            self.colds.results.append(result)
            self._record(result, purpose=self.purpose, expected=Expectation(None, 0), problem=problem,
                         state=State.COLD)
        return result

    def _checks_output(self) -> bool:
        # The first round of every cell; for a cold cell the check is that two computations agree.
        return self.check_output and self._round == self._first_round + 1

    def target(self, tokens: list[int]) -> RequestResult:
        checked = self._checks_output()
        self._pending = stream_completion(self.endpoint, tokens, OUTPUT_TOKENS if checked else 1,
                                          logprobs=TIE_CANDIDATES if checked else None)
        return self._pending

    def _check_output(self, result: RequestResult) -> OutputCheck:
        """The same prompt recomputed under a fresh cache_salt (no cache may answer it) must give the same
        tokens and logprobs; past a near-tie the hit is continued from the recompute's tokens."""
        reference = self._reference
        if reference is None:
            salt = f"{self.recorder.salt}|recompute|{self.backend.name}|{self.cell.id}|{self._round}"
            reference = recompute(self.endpoint, self._prompt.tokens, salt)
        return compare_outputs(result, reference, continuation(self.endpoint, self._prompt.tokens))

    def teardown(self, tokens: list[int] | None = None) -> None:
        """After each round, outside the timed part: sources, checks and the record."""
        self._complete_round()

    def _complete_round(self) -> None:
        if self._pending is None:
            return
        result, self._pending = self._pending, None
        attach_sources(self.endpoint, self._before, result)
        settings = self.recorder.settings
        expect = self._expectation(self.cell, len(self._prompt.prefix))
        if result.connector.get("kvoffload:loads_declined_total"):
            # The admission rule chose to recompute: nothing may come from the tier.
            expect = Expectation(None, 0)
        release = getattr(self.endpoint, "release", DEFAULT)
        problem = expect.as_counted_by(release).check(result.cached_by_source)
        proof = self.backend.load_proof
        tier_hit = self.cell.state is State.TIER_HIT and bool(expect.tokens)
        if problem is None and proof is not None and tier_hit:
            problem = proof(result.connector, expect.tokens, settings.kv_bytes_per_token)
        output = None
        if self._checks_output():
            check = self._check_output(result)
            output = {"output_checked": True, **check.record()}
            if check.difference:
                problem = f"{problem}; {check.difference}" if problem else check.difference
        if problem:
            self.outcome.failures.append(f"round {self._round}: {problem}")
        self.outcome.results.append(result)
        if tier_hit:
            # Without a load proof, vLLM's per-source counter is all: it moves when the scheduler accepts
            # the tokens, even when the load then fails (lmcache-inproc-disk: LMCache's in-process connector
            # reports no load counters to vLLM).
            output = {**(output or {}), "verified_by": SCHEDULER_ONLY if proof is None else "load counters"}
        if expect.tokens:
            # How this server's vLLM counts cached tokens by source (by tier from 0.32 on: core/vllm_releases.py).
            output = {**(output or {}), "sources_counted": release.verification}
        if self.paired_engine and tier_hit:
            output = {**(output or {}), **self._engine_beside()}
        self._record(result, purpose=self.purpose, expected=expect, problem=problem, output=output)

    def _expectation(self, cell: Cell, prefix_tokens: int) -> Expectation:
        """What `cell`'s request with a `prefix_tokens` shared prefix must report by source on this backend."""
        settings = self.recorder.settings
        return expectation(cell, prefix_tokens, self.backend.kv_block(settings), self.backend.tier,
                           self.backend.granularity(settings), self.backend.last_block_source,
                           self.backend.serves_all_but_last_token)

    def _engine_beside(self) -> dict:
        """Right after a tier hit, outside its timing: an engine hit of the same prefix (the tier hit left it
        in the engine's cache) with a suffix of its own, so it computes what the hit computed and stores
        nothing the next round finds; its time and whether its sources were the engine's."""
        prompt = self.prompt("engine-beside") if self._prompt.suffix else self._prompt
        result = measure(self.endpoint, list(prompt.tokens))
        expect = self._expectation(Cell(self.cell.length, self.cell.fraction, State.ENGINE_HIT), len(prompt.prefix))
        release = getattr(self.endpoint, "release", DEFAULT)
        problem = expect.as_counted_by(release).check(result.cached_by_source)
        return {"engine_beside_s": result.client_ttft_s, "engine_beside_problem": problem}

    def _record(self, result: RequestResult, purpose: str, expected=None, problem: str | None = None,
                output: dict | None = None, state: State | None = None) -> None:
        cold = state is State.COLD
        record = {
            "backend": self.backend.name,
            "length": self.cell.length,
            "fraction": 0.0 if cold else self.cell.fraction,
            "state": (state or self.cell.state).value,
            "round": self._round,
            "purpose": purpose,
            **result.to_dict(),
        }
        record.pop("output_token_ids", None)
        record.pop("top_logprobs", None)
        if purpose != "prime" and not cold and self._tier_read is not None:
            record["tier_page_cache"], self._tier_read = self._tier_read, None
        if expected is not None:
            record["expected_source"] = expected.source
            record["expected_cached"] = expected.tokens
            record["verified"] = problem is None
            record["problem"] = problem
        if output:
            record.update(output)
        self.recorder.keep(record)

    def run(self, rounds: int, benchmark=None) -> CellOutcome:
        if benchmark is not None and getattr(benchmark, "enabled", False):
            benchmark.pedantic(self.target, setup=self.setup, teardown=self.teardown, rounds=rounds, iterations=1)
        else:
            for _ in range(rounds):
                args, _ = self.setup()
                self.target(*args)
                self.teardown(*args)
        if benchmark is not None:
            benchmark.extra_info.update(self.extra_info())
        return self.outcome

    def extra_info(self) -> dict:
        sources: dict[str, float] = {}
        for r in self.outcome.results:
            for s, n in r.cached_by_source.items():
                sources[s] = sources.get(s, 0) + n / len(self.outcome.results)
        return {
            "backend": self.backend.name,
            "length": self.cell.length,
            "fraction": self.cell.fraction,
            "state": self.cell.state.value,
            "cached_tokens_by_source": sources,
            "ttft_s": self.outcome.ttfts,
        }
