"""tile_kernels.megakernel on the CPU: the schedule checker accepts every built schedule and rejects mutated ones, and
the reference interpreter, under random legal interleavings of the per-SM queues, matches the eager torch decode step
over several steps with a growing context."""

import math
import os
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tile_kernels.megakernel import (  # noqa: E402
    DeadlockError,
    DecoderConfig,
    Kind,
    Schedule,
    ScheduleError,
    Tiling,
    build_decode_step,
    build_graph,
    check_schedule,
    decode_step,
    find_problems,
    interpret,
    pack_weights,
    schedule,
)
from tile_kernels.megakernel.schedule import encode  # noqa: E402
from tile_kernels.megakernel.weights import layer_tensors, layer_weights  # noqa: E402


@st.composite
def problems(draw, max_layers=3):
    kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    config = DecoderConfig(
        num_layers=draw(st.integers(1, max_layers)),
        hidden=draw(st.integers(1, 40)),
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=2 * draw(st.integers(1, 5)),
        intermediate=draw(st.integers(1, 48)),
        max_seq=draw(st.integers(1, 12)),
        rms_eps=1e-5,
        rope_theta=draw(st.sampled_from([10000.0, 500000.0])),
        qkv_bias=draw(st.booleans()),
    )
    tiling = Tiling(
        qkv=draw(st.integers(1, 40)),
        o=draw(st.integers(1, 40)),
        gateup=draw(st.integers(1, 50)),
        down=draw(st.integers(1, 40)),
        kv_splits=draw(st.integers(1, 5)),
    )
    return config, tiling, draw(st.integers(1, 9))


def random_weights(config, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(config.num_layers):
        for short, hf, shape in layer_tensors(config):
            scale = 1.0 if len(shape) == 1 else shape[1] ** -0.5
            # norms' weights around 1, biases around 0, projections ~ 1/sqrt(fan-in): activations stay O(1)
            w = torch.randn(shape, generator=g, dtype=torch.float64) * (0.3 if len(shape) == 1 else scale)
            out[f"model.layers.{i}.{hf}"] = (w + (1.0 if short.endswith("norm") else 0.0)).to(dtype)
    return out


def built(config, tiling, num_sms):
    graph = build_graph(config, tiling)
    return graph, schedule(graph, num_sms)


# ------------------------------------------------------------------------------------------------------------ checker


@given(problems())
def test_checker_accepts_built_schedules(problem):
    config, tiling, num_sms = problem
    graph, sched = built(config, tiling, num_sms)
    assert find_problems(graph, sched) == []
    assert sorted(t for q in sched.queues for t in q) == list(range(len(graph.tasks)))
    c, t = config, tiling
    per_layer = (
        math.ceil((c.num_heads + 2 * c.num_kv_heads) * c.head_dim / t.qkv)
        + c.num_kv_heads * t.kv_splits
        + c.num_kv_heads  # COMBINE, a group each
        + math.ceil(c.hidden / t.o)
        + math.ceil(c.intermediate / t.gateup)
        + math.ceil(c.hidden / t.down)
    )
    assert len(graph.tasks) == c.num_layers * per_layer


@given(problems())
def test_encoded_tables_hold_the_graph_and_the_queues(problem):
    graph, sched = built(*problem)
    enc = encode(graph, sched)
    assert enc["tasks"].dtype == enc["waits"].dtype == enc["queue_tasks"].dtype == np.int32
    for t, row in zip(graph.tasks, enc["tasks"].tolist()):
        kind, layer, lo, hi, split, w0, w1, signal = row
        assert (Kind(kind), layer, lo, hi, split, signal) == (t.kind, t.layer, t.lo, t.hi, t.split, t.signal)
        assert [tuple(w) for w in enc["waits"][w0:w1].tolist()] == list(t.waits)
    ptr = enc["queue_ptr"].tolist()
    assert [tuple(enc["queue_tasks"][a:b].tolist()) for a, b in zip(ptr, ptr[1:])] == list(sched.queues)


def mutate_waits(graph, tid, waits):
    task = graph.tasks[tid]
    graph.tasks[tid] = type(task)(**{**task.__dict__, "waits": tuple(waits)})


@given(problems(), st.data())
def test_checker_rejects_a_dropped_edge(problem, data):
    graph, sched = built(*problem)
    tid = data.draw(st.sampled_from([t.id for t in graph.tasks if t.waits]))
    waits = list(graph.tasks[tid].waits)
    del waits[data.draw(st.integers(0, len(waits) - 1))]
    mutate_waits(graph, tid, waits)
    found = find_problems(graph, sched)
    assert any(p.startswith("race: " + graph.tasks[tid].label) for p in found), found


@given(problems(), st.data())
def test_checker_rejects_a_wrong_threshold(problem, data):
    graph, sched = built(*problem)
    tid = data.draw(st.sampled_from([t.id for t in graph.tasks if t.waits]))
    waits = list(graph.tasks[tid].waits)
    i = data.draw(st.integers(0, len(waits) - 1))
    delta = data.draw(st.sampled_from([-1, 1, 2]))
    waits[i] = (waits[i][0], waits[i][1] + delta)
    mutate_waits(graph, tid, waits)
    found = find_problems(graph, sched)
    assert any(graph.tasks[tid].label in p and "tasks signal it" in p for p in found), found
    with pytest.raises(ScheduleError, match="invalid schedule"):
        check_schedule(graph, sched)


def move_before(sched, consumer, producer):
    """The consumer, taken out of its queue, put just before its producer in the producer's queue."""
    queues = [[t for t in q if t != consumer] for q in sched.queues]
    q = next(q for q in queues if producer in q)
    q.insert(q.index(producer), consumer)
    return Schedule(tuple(tuple(q) for q in queues))


@given(problems(), st.data())
def test_checker_rejects_a_consumer_before_its_producer_in_one_queue(problem, data):
    graph, sched = built(*problem)
    producers = graph.producers()
    consumer = data.draw(st.sampled_from([t for t in graph.tasks if t.waits]))
    producer = data.draw(st.sampled_from(producers[data.draw(st.sampled_from(consumer.waits))[0]]))
    bad = move_before(sched, consumer.id, producer)
    found = find_problems(graph, bad)
    assert any("later in the same queue" in p for p in found), found
    assert any(p.startswith("deadlock: ") for p in found), found
    with pytest.raises(DeadlockError, match=r"stuck at .* waiting for "):
        interpret(graph, bad, {}, torch.zeros(graph.config.hidden), torch.zeros(graph.config.kv_cache_shape()), 0)


@given(problems(), st.data())
def test_checker_rejects_a_swapped_queue_order(problem, data):
    config, tiling, _ = problem
    graph, sched = built(config, tiling, 1)  # one queue: every edge joins two positions of it
    consumer = data.draw(st.sampled_from([t for t in graph.tasks if t.waits]))
    producer = data.draw(st.sampled_from(graph.producers()[data.draw(st.sampled_from(consumer.waits))[0]]))
    queue = list(sched.queues[0])
    i, j = queue.index(producer), queue.index(consumer.id)
    queue[i], queue[j] = queue[j], queue[i]
    found = find_problems(graph, Schedule((tuple(queue),)))
    assert f"queue 0[{i}]: {consumer.label} waits for {graph.counters[graph.tasks[producer].signal]}" in "".join(found)


def chain(graph):
    """Tasks x -> y -> z, each waiting on the one before (a QKV tile -> an ATTN task -> a COMBINE of layer 0)."""
    producers = graph.producers()
    z = next(t for t in graph.tasks if t.kind == Kind.COMBINE)
    y = graph.tasks[producers[z.waits[0][0]][0]]
    x = graph.tasks[producers[y.waits[0][0]][0]]
    return x, y, z


@given(problems())
def test_a_cross_queue_deadlock_is_found_and_reported_with_its_stuck_waits(problem):
    config, tiling, num_sms = problem
    graph, sched = built(config, tiling, max(2, num_sms))
    x, y, z = chain(graph)
    # queue 0 runs z before x (and y's other producers, which wait for nothing), queue 1 runs y, then the rest in
    # topological order: z waits for y, y waits for x, x is behind z
    producers = graph.producers()
    others = sorted({p for cid, _ in y.waits for p in producers[cid]} - {x.id})
    rest = tuple(t.id for t in graph.tasks if t.id not in (x.id, y.id, z.id, *others))
    bad = Schedule(((z.id, x.id, *others), (y.id, *rest)) + ((),) * (sched.num_sms - 2))
    found = find_problems(graph, bad)
    assert not any("later in the same queue" in p for p in found), found  # each queue alone looks fine
    stuck_z = f"deadlock: queue 0 stuck at {z.label} waiting for {graph.counters[z.waits[0][0]]} = 0 < {z.waits[0][1]}"
    assert any(p.startswith(stuck_z) for p in found), found
    with pytest.raises(DeadlockError) as err:
        interpret(graph, bad, {}, torch.zeros(config.hidden), torch.zeros(config.kv_cache_shape()), 0, rng=1)
    assert any(
        s.startswith(f"queue 1 stuck at {y.label} waiting for {graph.counters[y.waits[0][0]]} = 0 < {y.waits[0][1]}")
        for s in err.value.stuck
    ), err.value.stuck


def test_checker_rejects_unscheduled_and_duplicated_tasks():
    graph, sched = built(DecoderConfig(1, 8, 2, 1, 4, 8, 4), Tiling(4, 4, 4, 4, 2), 3)
    queues = [list(q) for q in sched.queues]
    dropped = queues[0].pop()
    queues[1].append(queues[2][0])
    found = find_problems(graph, Schedule(tuple(tuple(q) for q in queues)))
    assert f"{graph.tasks[dropped].label} is not scheduled" in found
    assert any("already scheduled" in p for p in found), found


# -------------------------------------------------------------------------------------------------------- interpreter


@given(problems(), st.integers(0, 2**31 - 1), st.sampled_from([torch.float64, torch.float32]))
def test_interpreter_matches_the_eager_decode_step_over_a_growing_context(problem, seed, dtype):
    config, tiling, num_sms = problem
    graph, sched = built(config, tiling, num_sms)
    weights = random_weights(config, seed)
    packed = pack_weights(config, layer_weights(config, weights))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    cache_ref = torch.randn(config.kv_cache_shape(), generator=gen, dtype=torch.float64)  # a prefilled context
    cache = cache_ref.clone()
    steps = min(3, config.max_seq)
    start = rng.randrange(config.max_seq - steps + 1)
    x = torch.randn(config.hidden, generator=gen, dtype=torch.float64)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for position in range(start, start + steps):
        want = decode_step(config, weights, x, cache_ref, position)
        got = interpret(graph, sched, packed, x, cache, position, rng=rng, dtype=dtype)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(cache, cache_ref, rtol=tol, atol=tol)
        x = want


@given(problems(max_layers=2), st.integers(0, 2**31 - 1))
def test_every_interleaving_gives_the_same_bits(problem, seed):
    config, tiling, num_sms = problem
    graph, sched = built(config, tiling, num_sms)
    weights = random_weights(config, seed, torch.float32)
    packed = pack_weights(config, layer_weights(config, weights))
    x = torch.randn(1, config.hidden, generator=torch.Generator().manual_seed(seed))
    position = config.max_seq - 1
    caches = [torch.ones(config.kv_cache_shape(), dtype=torch.bfloat16) for _ in range(3)]
    rngs = [None, seed, seed + 1]  # the lowest runnable queue first, then two random interleavings
    outs = [interpret(graph, sched, packed, x, cache, position, rng=r) for cache, r in zip(caches, rngs)]
    assert outs[0].shape == (1, config.hidden) and outs[0].dtype == torch.float32
    assert not outs[0].isnan().any()
    for out, cache in zip(outs[1:], caches[1:]):
        assert torch.equal(out, outs[0]) and torch.equal(cache, caches[0])


def test_a_missing_dependency_poisons_the_result():
    """A GATEUP tile that no longer waits for the O projection, run first: it reads the NaN-poisoned h."""
    config = DecoderConfig(1, 8, 2, 1, 4, 8, 4)
    graph, sched = built(config, Tiling(4, 4, 4, 4, 2), 2)
    gateup = next(t for t in graph.tasks if t.kind == Kind.GATEUP)
    mutate_waits(graph, gateup.id, [])
    bad = Schedule(
        (
            (gateup.id,) + tuple(t for t in sched.queues[0] if t != gateup.id),
            *(tuple(t for t in q if t != gateup.id) for q in sched.queues[1:]),
        )
    )
    assert any(p.startswith("race: " + gateup.label) for p in find_problems(graph, bad))
    packed = pack_weights(config, layer_weights(config, random_weights(config, 0)))
    out = interpret(graph, bad, packed, torch.randn(8), torch.randn(config.kv_cache_shape()), 2)
    assert out.isnan().all()


# --------------------------------------------------------------------------------------------- config, API and errors

LLAMA_3_2_1B = {
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}


QWEN2_0_5B = {  # Qwen2-0.5B's config.json (the keys the mega-kernel reads): q / k / v biases, 14 heads over 2
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}


def test_config_from_hf_of_qwen2_has_qkv_biases():
    c = DecoderConfig.from_hf(QWEN2_0_5B)
    assert c.qkv_bias and (c.num_heads, c.num_kv_heads, c.head_dim, c.max_seq) == (14, 2, 64, 32768)
    assert not DecoderConfig.from_hf(LLAMA_3_2_1B).qkv_bias
    with pytest.raises(TypeError, match="qkv_bias must be a bool"):
        DecoderConfig(**{**c.__dict__, "qkv_bias": 1})
    names = [hf for _, hf, _ in layer_tensors(c)]
    assert "self_attn.q_proj.bias" in names and "self_attn.o_proj.bias" not in names


def test_config_from_hf_and_llama3_rope_scaling():
    c = DecoderConfig.from_hf(LLAMA_3_2_1B, max_seq=1025)
    assert (c.num_layers, c.hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate, c.max_seq) == (
        16,
        2048,
        32,
        8,
        64,
        8192,
        1025,
    )
    plain = DecoderConfig(**{**c.__dict__, "rope_scaling": None}).rope_inv_freq()
    scaled = c.rope_inv_freq()
    for f, s in zip(plain, scaled):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            assert s == f  # high frequencies kept
        elif wavelen > 8192:
            assert s == pytest.approx(f / 32)  # low frequencies slowed by the factor
        else:
            assert f / 32 < s < f  # interpolated
    assert scaled[0] == 1.0 and scaled[-1] < plain[-1]


@given(problems())
def test_every_task_waits_on_one_counter_at_most(problem):
    """An ATTN task waits once, on its group's QKV counter (the tiles of the group's rows; one counter a layer where a
    tile spans two groups), not on each tile: every wait is an acquire load's L2 round trip."""
    config, tiling, num_sms = problem
    graph, _ = built(config, tiling, num_sms)
    assert all(len(t.waits) <= 1 for t in graph.tasks)
    stride = (config.group + 2) * config.head_dim
    producers = graph.producers()
    for t in graph.tasks:
        if t.kind == Kind.ATTN:
            cid, threshold = t.waits[0]
            tiles = [graph.tasks[p] for p in producers[cid]]
            assert threshold == len(tiles) and all(p.kind == Kind.QKV and p.layer == t.layer for p in tiles)
            rows = set().union(*(range(p.lo, p.hi) for p in tiles))
            assert set(range(t.lo * stride, (t.lo + 1) * stride)) <= rows  # group t.lo's rows


def test_the_llama_3_2_1b_graph_schedules_onto_132_sms():
    c = DecoderConfig.from_hf(LLAMA_3_2_1B, max_seq=2048)
    graph = build_graph(c, Tiling.auto(c, 132), context_hint=1024)
    sched = schedule(graph, 132)
    check_schedule(graph, sched)
    weights = sum(r.hi - r.lo for t in graph.tasks for r in t.reads if r.buffer.startswith("w")) * 2
    assert weights / 4.8e12 * 1e9 > 400e3 and sched.est_finish_ns > weights / 4.8e12 * 1e9
    assert max(map(len, sched.queues)) - min(map(len, sched.queues)) <= len(graph.tasks) // 132
    attn = next(t for t in graph.tasks if t.kind == Kind.ATTN)  # the 12 QKV tiles of its group, one counter
    assert graph.counters[attn.waits[0][0]] == "qkv[0].0" and attn.waits[0][1] == 12


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"hidden_size": 8}, "lacks the keys"),
        ({**LLAMA_3_2_1B, "hidden_act": "gelu"}, "hidden_act must be 'silu', got 'gelu'"),
        ({**LLAMA_3_2_1B, "attention_bias": True}, "attention_bias must be false"),
        ({**LLAMA_3_2_1B, "rope_scaling": {"rope_type": "yarn"}}, "rope_type 'llama3', got 'yarn'"),
        ({**LLAMA_3_2_1B, "num_key_value_heads": 5}, "multiple of num_kv_heads, got 32 and 5"),
    ],
)
def test_config_errors(hf, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_hf(hf)


def test_build_decode_step_interpreter_and_errors():
    config = DecoderConfig(2, 12, 4, 2, 4, 20, 6)
    weights = random_weights(config, 3)
    step = build_decode_step(config, weights, backend="interpreter", num_sms=4, seed=0)
    cache = torch.randn(config.kv_cache_shape(), dtype=torch.float64)
    cache_ref = cache.clone()
    x = torch.randn(1, 12, dtype=torch.float64)
    for position in range(3):
        x, want = step(x, cache, position), decode_step(config, weights, x, cache_ref, position)
        torch.testing.assert_close(x, want, rtol=1e-10, atol=1e-10)
    if os.environ.get("TRITON_INTERPRET") != "1":  # CPU weights, no interpreter: the Triton backend says what it needs
        with pytest.raises(RuntimeError, match="needs a CUDA GPU and weights on it, or TRITON_INTERPRET=1"):
            build_decode_step(config, weights)
    with pytest.raises(ValueError, match="backend must be one of"):
        build_decode_step(config, weights, backend="cuda")
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=rf"weights\['{name}'\]: expected shape \(20, 12\), got \(12, 20\)"):
        build_decode_step(config, {**weights, name: weights[name].T}, backend="interpreter")
    with pytest.raises(ValueError, match="missing 'model.layers.0.input_layernorm.weight'"):
        build_decode_step(config, {k: v for k, v in weights.items() if "layernorm" not in k}, backend="interpreter")
    with pytest.raises(ValueError, match=r"hidden must be \(12,\) or \(1, 12\), got \(2, 12\)"):
        step(torch.zeros(2, 12), cache, 0)
    with pytest.raises(ValueError, match=r"position must be in \[0, 6\), got 6"):
        step(torch.zeros(12), cache, 6)
    with pytest.raises(ValueError, match=r"kv_cache must be \(2, 2, 6, 2, 4\), got"):
        step(torch.zeros(12), cache[:, :, :5], 0)


# ------------------------------------------------------------------------------------------ the persistent kernel

CPU = os.environ.get("TILE_KERNELS_TEST_DEVICE", "cpu") == "cpu"
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU suite runs the kernel in Triton's interpreter"
)


def kernel_for(config, tiling, num_sms, weights, device="cpu", **kw):
    from tile_kernels.megakernel.kernel import Megakernel

    graph = build_graph(config, tiling)
    sched = schedule(graph, num_sms)
    packed = pack_weights(config, layer_weights(config, weights))
    return Megakernel(graph, sched, packed, device, **kw)


@needs_interpreter
@settings(max_examples=8)
@given(problems(max_layers=2), st.integers(0, 2**31 - 1), st.sampled_from([16, 128, 16384]), st.booleans())
def test_kernel_writes_every_buffer_like_the_interpreter(problem, seed, tile_budget, evict_first):
    """Every task body of the kernel (grid=(1,), Triton's interpreter), in a random legal interleaving of the queues,
    writes its NaN-poisoned scratch buffers, the KV cache row and the output as the reference interpreter does; small
    tile budgets make every GEMV loop run several (masked) tiles, as the real shapes do; with the weight loads' L2
    eviction policy or without."""
    from tile_kernels.megakernel.kernel import SCRATCH

    config, tiling, num_sms = problem
    weights = random_weights(config, seed, torch.float32)
    kernel = kernel_for(config, tiling, num_sms, weights, seed=seed, tile_budget=tile_budget,
                        weights_evict_first=evict_first)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(config.kv_cache_shape(), generator=gen)
    cache_ref = cache.clone()
    x = torch.randn(config.hidden, generator=gen)
    position = random.Random(seed).randrange(config.max_seq)
    want: dict = {}
    out_ref = interpret(kernel.graph, kernel.schedule, pack_weights(config, layer_weights(config, weights)), x,
                        cache_ref, position, dtype=torch.float32, buffers=want)  # fmt: skip
    out = kernel(x, cache, position)
    for name in sorted(kernel.graph.buffers):
        if name[: name.index("[")] in SCRATCH and name in want:
            if name in kernel.graph.inputs or name == kernel.graph.output:
                continue
            torch.testing.assert_close(kernel.scratch(name), want[name], rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(cache, cache_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_triton_step_over_a_growing_context_and_epochs():
    """build_decode_step(backend="triton") on CPU: several steps against the float64 eager step; the counters end at
    epoch x producers after every launch (no reset between steps), and restart when int32 would wrap. A 16-element
    tile budget makes every GEMV loop run several tiles with a masked last one (the real shapes' several tiles)."""
    config = DecoderConfig(2, 24, 4, 2, 6, 40, 9, rope_scaling=None)
    weights = random_weights(config, 5, torch.float32)
    step = build_decode_step(config, weights, num_sms=3, tiling=Tiling(16, 8, 16, 8, 3), seed=1, tile_budget=16)
    assert step.kernel.meta["BK_QKV"] == step.kernel.meta["BK_D"] == 16 and step.kernel.meta["BK_O"] == 16
    producers = torch.tensor([len(p) for p in step.graph.producers()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(config.kv_cache_shape(), generator=gen)
    cache_ref = cache.double()
    x = torch.randn(1, config.hidden, generator=gen)
    w64 = {k: v.double() for k, v in weights.items()}
    for epoch, position in enumerate(range(4, 8), 1):
        if epoch == 4:  # the next launch would overflow int32 thresholds: counters zeroed, epoch 1 again
            step.kernel.epoch = (2**31 - 1) // step.kernel.max_threshold
            epoch = 1
        want = decode_step(config, w64, x.double(), cache_ref, position)
        x = step(x, cache, position)
        assert x.shape == (1, config.hidden) and x.dtype == torch.float32
        torch.testing.assert_close(x.double(), want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(cache.double(), cache_ref, rtol=2e-5, atol=2e-5)
        assert step.kernel.epoch == epoch
        assert torch.equal(step.kernel.counters, epoch * producers)


@needs_interpreter
def test_staged_launches_match_the_persistent_kernel():
    """The benchmark's per-op baseline: the same task bodies, one launch per op of a layer, no counters."""
    config = DecoderConfig(2, 20, 6, 2, 4, 36, 7)
    weights = random_weights(config, 9, torch.float32)
    kernel = kernel_for(config, Tiling(16, 8, 12, 8, 2), 4, weights)
    cache = torch.randn(config.kv_cache_shape(), generator=torch.Generator().manual_seed(9))
    cache2 = cache.clone()
    x = torch.randn(config.hidden)
    for position in (0, 6):
        want = kernel(x, cache, position)
        got = kernel.staged(x, cache2, position)
        assert torch.equal(cache, cache2)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    kinds = [Kind.QKV, Kind.ATTN, Kind.COMBINE, Kind.OPROJ, Kind.GATEUP, Kind.DOWN, Kind.QKV]
    assert [k for k, _, _ in kernel.stages[:7]] == kinds


@needs_interpreter
def test_a_traced_step_records_every_task_in_a_legal_order(tmp_path):
    """step.trace(): the same hidden and cache as an untraced step; every task gets wait <= run < end on its program
    (the interpreter's logical clock: queue order), each wait met by enough of its counter's producers ended before
    the task ran; the Chrome trace holds one body event a task on its program's thread; the
    table a row per kind."""
    import json

    from tile_kernels.megakernel import Trace

    config = DecoderConfig(2, 20, 6, 2, 4, 36, 7)
    weights = random_weights(config, 3, torch.float32)
    step = build_decode_step(config, weights, num_sms=4, tiling=Tiling(16, 8, 12, 8, 2), seed=2)
    cache = torch.randn(config.kv_cache_shape(), generator=torch.Generator().manual_seed(3))
    cache2 = cache.clone()
    x = torch.randn(1, config.hidden)
    want = step(x, cache, 5)
    got, trace = step.trace(x, cache2, 5)
    assert isinstance(trace, Trace) and torch.equal(got, want) and torch.equal(cache, cache2)
    t, tasks = trace.times, step.graph.tasks
    assert t.shape == (len(tasks), 4) and t[:, :3].min() == 0 and set(t[:, 3].tolist()) == {0}
    assert (t[:, 0] < t[:, 1]).all() and (t[:, 1] < t[:, 2]).all()
    producers = step.graph.producers()
    for task in tasks:
        for cid, threshold in task.waits:
            assert sum(t[p, 2] < t[task.id, 1] for p in producers[cid]) >= threshold, task.label
    trace.save(tmp_path / "step.json")
    events = json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    bodies = [e for e in events if e.get("ph") == "X" and e["cat"] != "wait"]
    assert sorted(e["name"] for e in bodies) == sorted(task.label for task in tasks)
    assert all(e["tid"] == 0 and e["dur"] > 0 for e in bodies)
    table = trace.table()
    for kind in {Kind(task.kind).name for task in tasks}:
        row = next(line for line in table.splitlines() if line.startswith(f"| {kind} |"))
        assert int(row.split("|")[2]) == sum(Kind(task.kind).name == kind for task in tasks)
    with pytest.raises(ValueError, match="needs backend='triton'"):
        build_decode_step(config, weights, backend="interpreter").trace(x, cache, 5)
    # the trace balances a rebuilt step's queues (the same graph), which computes the same step
    rebuilt = build_decode_step(config, weights, num_sms=4, tiling=Tiling(16, 8, 12, 8, 2), seed=2, task_costs=trace)
    torch.testing.assert_close(rebuilt(x, cache.clone(), 5), want)
    with pytest.raises(ValueError, match="task_costs is the trace of another graph"):
        build_decode_step(config, weights, num_sms=4, tiling=Tiling(8, 8, 12, 8, 2), task_costs=trace)


def test_schedule_by_measured_costs():
    """schedule(costs_ns=...): a task measured costly keeps its SM to itself while its stage's other tasks run
    elsewhere; a cost vector of another length raises."""
    graph = build_graph(DecoderConfig(2, 20, 6, 2, 4, 36, 7), Tiling(16, 8, 12, 8, 2))
    heavy = next(t for t in graph.tasks if t.kind == Kind.ATTN)
    costs = [1.0] * len(graph.tasks)
    costs[heavy.id] = 1e6
    sched = schedule(graph, 4, costs_ns=costs)
    check_schedule(graph, sched)
    queue = next(q for q in sched.queues if heavy.id in q)
    after = [graph.tasks[t] for t in queue[queue.index(heavy.id) + 1 :]]
    assert not any(t.kind == Kind.ATTN and t.layer == heavy.layer for t in after)
    assert sched.est_finish_ns >= 1e6
    with pytest.raises(ValueError, match="costs_ns must hold a number >= 0 for each"):
        schedule(graph, 4, costs_ns=costs[:-1])


@needs_interpreter
def test_an_unmet_wait_names_the_stuck_task_and_counter():
    """A wait whose threshold no launch reaches: the step stops and raises, naming the task and the counter (the
    debug watchdog's record; in the interpreter the wait is found unmet at once); the counters restart after."""
    config = DecoderConfig(1, 12, 2, 1, 4, 16, 5)
    weights = random_weights(config, 2, torch.float32)
    kernel = kernel_for(config, Tiling(8, 8, 8, 8, 2), 2, weights)
    graph = kernel.graph
    oproj = next(t for t in graph.tasks if t.kind == Kind.OPROJ)
    cid, th = oproj.waits[0]
    kernel.waits[kernel.tasks[oproj.id, 5]] = torch.tensor([cid, th + 1], dtype=torch.int32)
    cache = torch.randn(config.kv_cache_shape())
    match = (
        rf"program 0 stuck at {re.escape(oproj.label)} waiting for {re.escape(graph.counters[cid])} = {th} < {th + 1}"
    )
    with pytest.raises(RuntimeError, match=match):
        kernel(torch.randn(12), cache, 3)
    assert kernel.epoch == 0 and not kernel.counters.any() and not kernel.err.any()


@needs_interpreter
def test_triton_step_bad_inputs():
    config = DecoderConfig(1, 8, 2, 1, 4, 8, 4)
    step = build_decode_step(config, random_weights(config, 0, torch.float32), num_sms=2)
    cache = torch.randn(config.kv_cache_shape())
    strided = torch.randn(config.kv_cache_shape()[::-1]).permute(4, 3, 2, 1, 0)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        step(torch.zeros(8), strided, 0)
    with pytest.raises(ValueError, match=r"position must be in \[0, 4\), got -1"):
        step(torch.zeros(8), cache, -1)
    with pytest.raises(TypeError, match="position must be an int, got float"):
        step(torch.zeros(8), cache, 1.0)
    with pytest.raises(ValueError, match="timeout_s must be a number > 0, got 0"):
        build_decode_step(config, random_weights(config, 0, torch.float32), timeout_s=0)
    with pytest.raises(ValueError, match="tile_budget must be a power of two"):
        build_decode_step(config, random_weights(config, 0, torch.float32), tile_budget=3000)
    weights, tiling = random_weights(config, 0, torch.float32), step.graph.tiling
    with pytest.raises(ValueError, match="prefetch must be True or None, got 'later'"):
        kernel_for(config, tiling, 2, weights, prefetch="later")
    with pytest.raises(TypeError, match="weights_evict_first must be a bool, got 'yes'"):
        kernel_for(config, tiling, 2, weights, weights_evict_first="yes")
    with pytest.raises(TypeError, match="one_poller must be a bool, got 1"):
        kernel_for(config, tiling, 2, weights, one_poller=1)
    with pytest.raises(ValueError, match=r"poll_sleep_ns must be an int in \[0, 1000000\], got -1"):
        kernel_for(config, tiling, 2, weights, poll_sleep_ns=-1)
    with pytest.raises(ValueError, match="prefetch_bytes must be None or an int >= 16, got 8"):
        kernel_for(config, tiling, 2, weights, prefetch_bytes=8)


def test_the_gpu_path_compiles_for_sm90():
    """Without a GPU: the persistent kernel (debug watchdog, L2 prefetch before each task's waits; with evict_first
    weight loads and one poller a CTA), a staged PDL launch, a traced launch and every body with its int arguments
    specialized to 1 compile for sm_90 through ptxas, with
    the acquire loads, nanosleep backoff, globaltimer, release signal, bulk and line L2 prefetches and griddepcontrol
    in the PTX (a subprocess: the suite's process interprets)."""
    import json
    import subprocess
    import sys

    code = """
import json, sys
from tile_kernels.megakernel.kernel import compile_ahead
meta = json.loads(sys.argv[1])
persistent = compile_ahead(meta, DEBUG=True).asm["ptx"]
staged = compile_ahead(meta, MODE=1, KIND=3, PDL=True, PREFETCH=True).asm["ptx"]
traced = compile_ahead(meta, TRACING=True).asm["ptx"]
evicting = compile_ahead(meta, EVICT="evict_first", ONE_POLLER=True, SLEEP_NS=0).asm["ptx"]
assert "L2::evict_first" in evicting and "L2::evict_first" not in persistent, "the weight loads' eviction policy"
assert "%tid.x" in evicting and "ld.acquire.gpu.global.b32" in evicting, "thread 0's poll loop"
ones = dict.fromkeys(("epoch", "position", "task0", "NL", "H", "INTER", "HK", "MAXSEQ", "S"), 1)
for kind in range(6):  # Triton passes an int argument equal to 1 as a constexpr: every body must compile so
    compile_ahead(meta, MODE=1, KIND=kind, **ones)
compile_ahead(meta, **ones)
print(json.dumps([persistent, staged, traced]))
"""
    # Llama-3.2-1B's meta at 132 SMs and the default tile budget (16384 elements)
    meta = dict(G=4, D=64, BLOCK_H=2048, BN_QKV=32, BK_QKV=512, BN_O=16, BK_O=1024, BN_GU=64, BK_GU=128, BN_D=16,
                BK_D=1024, BLOCK_S=16, BLOCK_T=64, BLOCK_G=16, BLOCK_GC=4, BLOCK_DH=32, PF_CHUNKS=256,
                PF_BYTES=1024, EVICT="", ONE_POLLER=True, SLEEP_NS=256, INTERPRET=False, DEBUG=False,
                PREFETCH=True)  # fmt: skip
    # its arenas' layout: (base, stride) of x, h, qkv, att, act, ao in A, then of the 8 weight buffers in W, 16 layers
    strides = ([2048, 2048, 3072, 16 * 32 * 66, 8192, 2048],
               [2048, 2048, 3072 * 2048, 2048 * 2048, 8192 * 2048, 8192 * 2048, 2048 * 8192, 3072])  # fmt: skip
    meta["OFFS"] = [(16 * sum(arena[:i]), arena[i]) for arena in strides for i in range(len(arena))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code, json.dumps(meta)], capture_output=True, text=True, env=env,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    persistent, staged, traced = json.loads(run.stdout.splitlines()[-1])
    assert "%globaltimer" in traced and "%globaltimer" not in staged  # the trace's clock; none untraced, no watchdog
    for needle in ("ld.acquire.gpu.global.b32", "nanosleep.u32", "%globaltimer", "cp.async.bulk.prefetch.L2.global",
                   "prefetch.global.L2::evict_last"):  # fmt: skip
        assert needle in persistent, needle
    # the release signal: a red (triton 3.9) or an atom whose result goes unused (triton 3.6)
    assert re.search(r"\b(red|atom)\.global\.gpu\.release\.add\.u32", persistent), "release add"
    # the weight tiles load as 16-byte vectors (a 2-byte load an element would cut the bandwidth several times; the
    # few 2-byte loads are the bf16 input's, the norm weights' chunks and the q / k / v bias rows, about one element a
    # thread)
    assert "ld.global.v4.b32" in persistent and persistent.count("ld.global.b16") < 20
    assert "griddepcontrol.wait" in staged and "griddepcontrol.launch_dependents" in staged
    assert "cp.async.bulk.prefetch.L2.global" in staged and "ld.acquire" not in staged


# --------------------------------------------------------------------------------------------------------- GPU only

gpu = pytest.mark.skipif(CPU, reason="needs TILE_KERNELS_TEST_DEVICE=gpu (a CUDA GPU)")


def bf16_problem(config, seed, device="cuda"):
    """Random bf16 weights (drawn on the device: the 1B stack is ~1e9 numbers), a prefilled cache and a hidden."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for i in range(config.num_layers):
        for short, hf, shape in layer_tensors(config):
            w = torch.randn(shape, generator=gen, device=device)
            w = w * 0.3 + short.endswith("norm") if len(shape) == 1 else w * shape[1] ** -0.5
            weights[f"model.layers.{i}.{hf}"] = w.to(torch.bfloat16)
    cache = (torch.randn(config.kv_cache_shape(), generator=gen, device=device) * 0.5).to(torch.bfloat16)
    x = torch.randn(1, config.hidden, generator=gen, device=device).to(torch.bfloat16)
    return weights, cache, x


@gpu
@pytest.mark.parametrize("shape", ["small", "llama-3.2-1b", "qwen2-0.5b"])
def test_gpu_kernel_matches_the_eager_step_over_a_growing_context(shape):
    """The full-grid kernel on the GPU against the eager step: |kernel - ref64| <= 2 |eager bf16 - ref64| + atol,
    several steps with a growing context, the KV cache rows too; Qwen2-0.5B's shape with its q / k / v biases."""
    if shape == "small":
        config = DecoderConfig(3, 256, 8, 2, 32, 512, 96)
        start, steps = 40, 4
    elif shape == "qwen2-0.5b":
        config = DecoderConfig.from_hf(QWEN2_0_5B, max_seq=600)
        start, steps = 500, 4
    else:
        config = DecoderConfig.from_hf(LLAMA_3_2_1B, max_seq=1100)
        start, steps = 1020, 4
    weights, cache, x = bf16_problem(config, 11)
    w64 = {k: v.double() for k, v in weights.items()}
    step = build_decode_step(config, weights, context_hint=start, debug=True, timeout_s=5.0)  # a hang raises
    assert step.kernel.grid == (torch.cuda.get_device_properties(0).multi_processor_count,)
    cache_eager, cache_ref = cache.clone(), cache.double()
    for position in range(start, start + steps):
        ref = decode_step(config, w64, x.double(), cache_ref, position)
        eager = decode_step(config, weights, x, cache_eager, position)
        got = step(x, cache, position)
        torch.cuda.synchronize()
        assert got.dtype == torch.bfloat16 and not got.isnan().any()
        err, err_eager = (got.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
        assert err <= 2 * err_eager + 1e-2 * ref.abs().max().item(), (position, err, err_eager)
        row = cache[:, :, position].double()
        assert (row - cache_ref[:, :, position]).abs().max() <= 2 * (
            cache_eager[:, :, position].double() - cache_ref[:, :, position]
        ).abs().max() + 1e-2
        x = got
    out = step.kernel.staged(x, cache.clone(), start + steps)
    torch.testing.assert_close(out, step(x, cache.clone(), start + steps))  # bf16 tolerance: other compiled code


@gpu
def test_gpu_trace_times_every_task():
    """On the GPU: a traced step gives the untraced step's output; every task has 0 <= wait <= run < end within the
    step, on a program of the grid; each wait met by enough producers ended (by %globaltimer) before the task ran."""
    config = DecoderConfig(3, 256, 8, 2, 32, 512, 96)
    weights, cache, x = bf16_problem(config, 12)
    step = build_decode_step(config, weights, context_hint=40)
    want = step(x, cache.clone(), 40)
    got, trace = step.trace(x, cache.clone(), 40)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    t = trace.times
    assert (t[:, 0] >= 0).all() and (t[:, 0] <= t[:, 1]).all() and (t[:, 1] < t[:, 2]).all()
    assert set(t[:, 3].tolist()) <= set(range(step.kernel.grid[0]))
    producers = step.graph.producers()
    for task in step.graph.tasks:
        for cid, threshold in task.waits:
            assert sum(t[p, 2] <= t[task.id, 1] for p in producers[cid]) >= threshold, task.label
    assert "| GATEUP |" in trace.table()


@gpu
@pytest.mark.parametrize("shape", ["small", "llama-3.2-1b"])
def test_gpu_every_thread_polling_gives_the_default_steps(shape):
    """How the waits spin changes nothing else: every thread polling (one_poller=False; the default has thread 0
    alone poll, the CTA waiting at a barrier) gives the default's outputs and KV cache over a few steps, bit for
    bit."""
    from tile_kernels.megakernel.kernel import Megakernel

    if shape == "small":
        config = DecoderConfig(3, 256, 8, 2, 32, 512, 96)
    else:
        config = DecoderConfig.from_hf(LLAMA_3_2_1B, max_seq=128)
    weights, cache, x = bf16_problem(config, 5)
    step = build_decode_step(config, weights, context_hint=64)
    packed = pack_weights(config, layer_weights(config, weights))
    other = Megakernel(step.graph, step.schedule, packed, "cuda", one_poller=False)
    cache_other = cache.clone()
    for position in range(60, 64):
        want, got = step(x, cache, position), other(x, cache_other, position)
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        x = want
    torch.testing.assert_close(cache_other, cache, rtol=0, atol=0)


@gpu
def test_gpu_watchdog_turns_a_hang_into_an_error():
    """debug=True: a wait that no task can satisfy aborts every program after the timeout and raises, naming the
    stuck task and counter; the next (correct) launch works again."""
    import time

    config = DecoderConfig(2, 256, 8, 2, 32, 512, 64)
    weights, cache, x = bf16_problem(config, 3)
    step = build_decode_step(config, weights, debug=True, timeout_s=0.2)
    kernel, graph = step.kernel, step.graph
    good = step(x, cache.clone(), 10)
    down = next(t for t in graph.tasks if t.kind == Kind.DOWN and t.layer == 1)
    cid, th = down.waits[0]
    row = int(kernel.tasks[down.id, 5])
    kernel.waits[row, 1] = th + 1
    started = time.perf_counter()
    with pytest.raises(
        RuntimeError, match=rf"stuck at {re.escape(down.label)} waiting for {re.escape(graph.counters[cid])}"
    ):
        step(x, cache.clone(), 10)
    assert time.perf_counter() - started < 10
    kernel.waits[row, 1] = th
    torch.testing.assert_close(step(x, cache.clone(), 10), good, rtol=0, atol=0)


@needs_interpreter
def test_bench_plumbing_on_cpu(monkeypatch, tmp_path):
    """`tile-kernels bench --megakernel`'s per-shape run on a tiny stack in Triton's interpreter, timers replaced (one
    call each): every implementation and variant runs, the megakernels agree with the eager step, the table renders
    with the traced step's table; the Chrome trace is written."""
    from tile_kernels.megakernel import bench

    calls = []

    def once(fn, *args, **kwargs):
        fn()
        calls.append(fn)
        return 100.0

    monkeypatch.setattr(bench, "_events_us", once)
    monkeypatch.setattr(bench, "_graph_us", once)
    monkeypatch.setitem(bench.SHAPES, "tiny", (2, 32, 4, 2, 8, 48))
    monkeypatch.setattr(bench, "CONTEXT", 9)
    saved = []  # the implementations timed at each save: a run cut short keeps what it measured
    result = bench.bench_shape("tiny", layers=1, device="cpu", trace_dir=str(tmp_path),
                               save=lambda shape: saved.append(list(shape["us"])))  # fmt: skip
    assert result["notes"] == {} and len(calls) == len(result["us"]) == 21
    assert saved == [list(result["us"])[: i + 1] for i in range(21)]
    assert all(v < 0.05 * result["max_abs_err_vs_eager"]["scale"] for k, v in result["max_abs_err_vs_eager"].items()
               if k != "scale"), result["max_abs_err_vs_eager"]  # fmt: skip
    table = bench.markdown({"gpu": "cpu", "date": "today", "copy_gbs": 1.0, "shapes": [result]})
    assert "| tiny | 9 | per-op, CUDA graph + PDL | 100 | 10000 |" in table
    assert "| tiny | 9 | megakernel, 4 KV splits | 100 |" in table
    assert "## tiny, context 9: one traced megakernel step" in table and "| GATEUP | " in table
    assert (tmp_path / "tiny_9_trace.json").exists() and "tiny_9_trace.json" in result["trace_files"]
    run = {"gpu": "cpu", "date": "today", "copy_gbs": 1.0, "shapes": []}
    for _ in range(2):  # saved again as it fills in: one entry
        bench._save(str(tmp_path), run, result)
    assert run["shapes"] == [result] and (tmp_path / "megakernel.md").read_text() == bench.markdown(run) + "\n"
    # --impl: the megakernel and the implementations named by a part of their name
    chosen = bench.bench_shape("tiny", layers=1, device="cpu", impls=["PDL", "no L2 prefetch"])
    assert list(chosen["us"]) == ["megakernel", "per-op, CUDA graph + PDL", "megakernel, no L2 prefetch"]
