"""In-process checks of the trainer's building blocks (CPU): the fast BlockMask construction, the FLOP formulas
behind the MFU numbers, and the synthetic data."""
from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

# The repository root is on sys.path (pytest's pythonpath in pyproject.toml): the trainer is examples.specdec.
from examples.specdec import data as data_mod, flops, masks, models  # noqa: E402
from examples.specdec.config import Config  # noqa: E402

DEFAULTS = Config()  # the trainer's defaults, for the model settings a test does not choose itself


def target_config(**shape: int) -> models.TargetConfig:
    """A built-in target of the given shape, without the synthetic prior, otherwise with the trainer's defaults."""
    return models.TargetConfig(seed=DEFAULTS.seed, prior_strength=0, rope_theta=DEFAULTS.rope_theta, **shape)


def drafter_config(vocab: int, dim: int, heads: int, ffn: int, k: int, kv: int) -> models.DrafterConfig:
    return models.DrafterConfig(vocab_size=vocab, dim=dim, heads=heads, ffn=ffn, ttt_steps=k, kv_heads=kv,
                                rope_theta=DEFAULTS.rope_theta)


@pytest.mark.parametrize("batch, seq, steps", [(2, 128, 3), (2, 200, 2), (1, 64, 2)])
def test_block_mask_matches_create_block_mask(batch: int, seq: int, steps: int) -> None:
    """Every tensor of the BlockMask built from one dense evaluation equals create_block_mask's."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = data_mod.MarkovData(64, batch, seq, min_doc=8, max_doc=90).batch(0).doc
    mod = masks.ttt_mod(doc, seq)
    dense = masks.dense_mask(mod, batch, seq, seq * steps, torch.device("cpu"))
    pairs = [(masks.block_mask_from_dense(dense[..., :seq * (i + 1)], mod),
              create_block_mask(mod, batch, None, seq, seq * (i + 1), device="cpu")) for i in range(steps)]
    causal = masks.document_causal_mod(doc)
    pairs.append((masks.block_mask_from_dense(masks.dense_mask(causal, batch, seq, seq, torch.device("cpu")), causal),
                  create_block_mask(causal, batch, None, seq, seq, device="cpu")))
    for mine, ref in pairs:
        assert mine.seq_lengths == ref.seq_lengths and tuple(mine.BLOCK_SIZE) == tuple(ref.BLOCK_SIZE)
        for a, b in zip(mine.as_tuple()[2:10], ref.as_tuple()[2:10]):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_mask_builder_equals_eager(device: str) -> None:
    """--mask-builder compiled: the compiled dense evaluation gives the eager builder's tensors (on CUDA this also
    covers inductor's GPU lowering of the stable descending argsort)."""
    doc = data_mod.MarkovData(64, 2, 256, min_doc=8, max_doc=90).batch(3).doc.to(device)
    got = masks._Compiled()("target", masks._target_tensors, doc)
    want = masks.block_tensors(masks.dense_mask(masks.document_causal_mod(doc), 2, 256, 256, doc.device))
    assert len(got) == len(want) == 8
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _ttt_attention_inputs(batch: int, seq: int, heads: int, kv_heads: int, steps: int, device: str,
                          dtype: torch.dtype):
    """Queries of TTT step ``steps - 1``, keys/values of steps 0..steps-1, and a packed batch's documents."""
    g = torch.Generator().manual_seed(0)
    doc = data_mod.MarkovData(64, batch, seq, min_doc=8, max_doc=90).batch(1).doc.to(device)
    make = lambda h: torch.randn(batch, h, seq, 16, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    q = make(heads).requires_grad_()
    kv = [(make(kv_heads).requires_grad_(), make(kv_heads).requires_grad_()) for _ in range(steps)]
    return doc, q, kv


def _concatenated_reference(doc, q, kv):
    """TTT attention as the pattern is defined: every step's keys along one axis under ``masks.ttt_mod``."""
    b, _, s, _ = q.shape
    keys, values = torch.cat([k for k, _ in kv], dim=2), torch.cat([v for _, v in kv], dim=2)
    dense = masks.dense_mask(masks.ttt_mod(doc, s), b, s, s * len(kv), q.device)
    gqa = keys.shape[1] != q.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=dense, enable_gqa=gqa)


@pytest.mark.parametrize("heads, kv_heads, steps", [(4, 4, 4), (4, 2, 3), (2, 1, 1)])
def test_ttt_attention_by_log_sum_exp_equals_concatenated_keys(heads: int, kv_heads: int, steps: int) -> None:
    """The drafter's TTT attention (step-0 keys under the document-causal mask, the diagonal keys of later steps
    merged through the log-sum-exp) equals attention over all steps' keys under ``ttt_mod``: output and the
    gradients of queries, keys and values (float64, packed documents, with and without grouped-query heads)."""
    doc, q, kv = _ttt_attention_inputs(2, 200, heads, kv_heads, steps, "cpu", torch.float64)
    causal = masks.dense_mask(masks.document_causal_mod(doc), 2, 200, 200, doc.device)
    out0, lse0 = models.attention(q, kv[0][0], kv[0][1], causal, return_lse=True)
    got = models.merge_diagonal(q, out0, lse0, kv[1:])
    want = _concatenated_reference(doc, q, kv)
    torch.testing.assert_close(got, want)
    inputs = [q] + [t for pair in kv for t in pair]
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), inputs), torch.autograd.grad((want * w).sum(), inputs)):
        torch.testing.assert_close(a, b)


def test_flex_log_sum_exp_is_the_natural_one() -> None:
    """``attention(..., return_lse=True)`` gives the same log-sum-exp (natural log, scaled scores) from flex
    (forward only: flex has no CPU backward) as from the dense path."""
    doc, q, kv = _ttt_attention_inputs(2, 256, 4, 2, 1, "cpu", torch.float32)
    k0, v0 = kv[0][0].detach(), kv[0][1].detach()
    q = q.detach()
    dense = masks.target_mask(doc)  # on the CPU a boolean mask; the same as a BlockMask for flex
    block = masks.block_mask_from_dense(dense, masks.document_causal_mod(doc))
    flex_out, flex_lse = models.attention(q, k0, v0, block, return_lse=True)
    dense_out, dense_lse = models.attention(q, k0, v0, dense, return_lse=True)
    torch.testing.assert_close(flex_lse, dense_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(flex_out, dense_out, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward needs CUDA")
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ttt_attention_compiled_flex_on_cuda(kv_heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path: compiled flex_attention returning the log-sum-exp (its gradient flows back through the
    kernel) merged with the diagonal, against the concatenated-keys reference: output and every gradient, bf16."""
    monkeypatch.setattr(masks, "BUILDER", DEFAULTS.mask_builder)  # what the trainer's set-up does
    doc, q, kv = _ttt_attention_inputs(2, 384, 4, kv_heads, 4, "cuda", torch.bfloat16)
    mask = masks.target_mask(doc)  # a BlockMask on CUDA: what the drafter step gets

    def drafter_attention(q, kv, mask):
        out0, lse0 = models.attention(q, kv[0][0], kv[0][1], mask, return_lse=True)
        return models.merge_diagonal(q, out0, lse0, kv[1:])

    got = torch.compile(drafter_attention, dynamic=False)(q, kv, mask)
    up = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    q64, kv64 = up(q), [(up(k), up(v)) for k, v in kv]
    want = _concatenated_reference(doc, q64, kv64)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    w = torch.randn_like(want)
    grads = torch.autograd.grad((got.double() * w).sum(), [q] + [t for p in kv for t in p])
    refs = torch.autograd.grad((want * w).sum(), [q64] + [t for p in kv64 for t in p])
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a.double(), b, atol=5e-2, rtol=5e-2)


def test_markov_batches_made_together_equal_one_at_a_time() -> None:
    """Batches are generated a block at a time and cached; each is still exactly what generating it alone gives,
    whichever thread asks first and in whatever order."""
    import threading

    blocked = data_mod.MarkovData(97, 3, 300, seed=5, block=4)
    alone = data_mod.MarkovData(97, 3, 300, seed=5, block=1)
    indices = [9, 0, 3, 17, 4, 16, 2, 30, 1]
    got: dict = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, blocked.batch(i))) for i in indices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in indices:
        a, b = got[i], alone.batch(i)
        assert a.index == b.index == i
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.doc, b.doc) and torch.equal(a.pos, b.pos)
    assert len(blocked._cache) <= blocked.cached_blocks


def test_flop_formulas_match_flop_counter() -> None:
    """The analytic FLOPs per token (target forward, drafter forward + backward) equal torch's FlopCounterMode
    on a small GQA model; attention through the math SDPA kernel (and the drafter's explicit scores), which
    compute every (query, key) pair, so the formulas get the dense key counts here: S step-0 keys at every TTT
    step (the diagonal keys of later steps are elementwise products, not matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    b, s, vocab, dim, heads, kv, ffn, layers, k = 2, 32, 64, 64, 4, 2, 96, 2, 3
    target = models.TargetLM(target_config(vocab_size=vocab, dim=dim, layers=layers, heads=heads, kv_heads=kv,
                                           ffn=ffn))
    tok = torch.randint(0, vocab, (b, s))
    pos = torch.arange(s).expand(b, s)
    doc = torch.zeros(b, s, dtype=torch.long)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        target(tok, pos, masks.target_mask(doc))
    shape = flops.Shape(vocab, dim, heads, kv, ffn, layers)
    assert fc.get_total_flops() == flops.target_flops_per_token(shape, keys=s) * b * s
    drafter = models.Drafter(drafter_config(vocab, dim, heads, ffn, k, kv), target.input_embedding(),
                             target.output_embedding())
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        loss, _ = models.ttt_loss(drafter, torch.randn(b, s, 3 * dim), tok, pos, doc, torch.randn(b, s, vocab), tok,
                                  masks.target_mask(doc), k, DEFAULTS.step_decay)
        loss.backward()
    expected = flops.drafter_flops_per_token_keys(flops.Shape(vocab, dim, heads, kv, ffn),
                                                  [s] * k) * b * s
    assert fc.get_total_flops() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_equals_the_log_softmax_form(dtype: torch.dtype) -> None:
    """The drafter's loss kernel (lse(z) - sum softmax(v) z, pointwise backward) gives the value and the gradient
    of -(softmax(v) * log_softmax(z)).sum(-1), eager and compiled; the target's logits get no gradient."""
    torch.manual_seed(0)
    z = (torch.randn(3, 5, 37) * 4).to(dtype).requires_grad_()
    v = (torch.randn(3, 5, 37) * 3).to(dtype).requires_grad_()
    w = torch.randn(3, 5)
    ref = -(torch.softmax(v.detach().float(), -1) * torch.log_softmax(z.float(), -1)).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), z)
    for fn in (models.soft_cross_entropy, torch.compile(models.soft_cross_entropy, backend="aot_eager")):
        out = fn(z, v)
        assert out.dtype == torch.float32 and out.shape == (3, 5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        (out * w).sum().backward()
        assert v.grad is None and z.grad is not None and z.grad.dtype == dtype
        torch.testing.assert_close(z.grad.float(), ref_grad.float(), atol=1e-5, rtol=1e-5)
        z.grad = None


def test_drafter_fused_projections_equal_separate_ones() -> None:
    """The drafter's q/k/v and gate/up matmuls against concatenated weights: same loss and gradients as the
    separate Linear layers (the parameters, and so checkpoints, are the same)."""
    torch.manual_seed(0)
    b, s, vocab, dim, heads, kv, ffn, k = 2, 32, 64, 64, 4, 2, 96, 3
    target = models.TargetLM(target_config(vocab_size=vocab, dim=dim, layers=2, heads=heads, kv_heads=kv, ffn=ffn))
    drafter = models.Drafter(drafter_config(vocab, dim, heads, ffn, k, kv), target.input_embedding(),
                             target.output_embedding()).double()
    assert drafter.attn.fused and drafter.mlp.fused
    tok = torch.randint(0, vocab, (b, s))
    pos = torch.arange(s).expand(b, s)
    doc = torch.zeros(b, s, dtype=torch.long)
    args = (torch.randn(b, s, 3 * dim, dtype=torch.float64), tok, pos, doc,
            torch.randn(b, s, vocab, dtype=torch.float64), tok, masks.target_mask(doc), k, DEFAULTS.step_decay)
    results = []
    for fused in (True, False):
        drafter.attn.fused = drafter.mlp.fused = fused
        drafter.zero_grad(set_to_none=True)
        loss, _ = models.ttt_loss(drafter, *args)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    (loss_f, grads_f), (loss_s, grads_s) = results
    torch.testing.assert_close(loss_f, loss_s)
    assert grads_f.keys() == grads_s.keys() and "attn.q.weight" in grads_f and "mlp.gate.weight" in grads_f
    for name in grads_f:
        torch.testing.assert_close(grads_f[name], grads_s[name], msg=name)


def test_llama_8b_shape_numbers() -> None:
    """Sanity of the cuda-8b accounting: ~15 GFLOP per token forward for a Llama-3.1-8B-shaped target (2 x its
    7.5B non-embedding weights plus the LM head), and a peak for the H200."""
    shape = flops.Shape(128256, 4096, 32, 8, 14336, 32)
    per_token = flops.target_flops_per_token(shape, keys=0)
    assert 14.9e9 < per_token < 16.1e9
    assert flops.peak_tflops("NVIDIA H200", bf16=True) == 989.4
    assert flops.peak_tflops("Some future part", bf16=True) is None


def test_markov_batches_are_pure_and_follow_the_chain() -> None:
    data = data_mod.MarkovData(97, 3, 300, seed=5)
    a, b = data.batch(7), data.batch(7)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.doc, b.doc) and torch.equal(a.pos, b.pos)
    assert not torch.equal(a.tokens, data.batch(8).tokens)
    tok, doc, pos = a.tokens.numpy(), a.doc.numpy(), a.pos.numpy()
    assert (tok[pos == 0] == data_mod.BOS).all() and (tok[pos > 0] > 0).all()
    assert ((pos[:, 1:] == pos[:, :-1] + 1) | (pos[:, 1:] == 0)).all()
    assert ((doc[:, 1:] != doc[:, :-1]) == (pos[:, 1:] == 0)).all()
    for r in range(tok.shape[0]):
        for t in range(1, tok.shape[1]):
            if pos[r, t] >= 2:
                assert tok[r, t] in data.succ[tok[r, t - 1]]
    assert abs(float(data.transition_logprobs().exp().sum(1).mean()) - 1.0) < 1e-5


def test_step_graph_never_captures_while_another_graph_is_still_warming_up() -> None:
    """--step-graphs: a capture while another thread still makes first calls (compiles, autotunes: device-wide
    synchronisations) breaks the capture. A StepGraph past its own warm-up therefore stays eager, without blocking,
    until every live StepGraph is warm. (CPU: nothing here may reach a capture.)"""
    from examples.specdec import graphs

    calls = []
    a = graphs.StepGraph(lambda x: calls.append(("a", x)), stream=object(), warmup=2)
    b = graphs.StepGraph(lambda x: calls.append(("b", x)), stream=object(), warmup=2)
    for i in range(5):
        a(i)
    assert not a.captured and calls == [("a", i) for i in range(5)]
    assert not graphs.all_warm()
    b(0)
    assert not graphs.all_warm()
    b(1)
    assert graphs.all_warm()  # the next call of either would capture (needs CUDA)
    with pytest.raises(ValueError, match="side stream"):
        graphs.StepGraph(lambda: None, stream=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_step_graph_replays_with_new_inputs_and_trains_like_eager() -> None:
    """A StepGraph of forward + backward + fused AdamW (capturable, tensor lr) gives the eager run's weights."""
    from examples.specdec import graphs

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda()
        lr = torch.full((), 1e-2, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)
        return model, opt, lr

    xs = [torch.randn(16, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(8)]
    ref, ref_opt, ref_lr = make()
    for i, x in enumerate(xs):
        ref_lr.fill_(1e-2 / (i + 1))
        ref_opt.zero_grad(set_to_none=False)
        ref(x).square().mean().backward()
        ref_opt.step()
    model, opt, lr = make()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

        def fwd_bwd(x):
            model(x).square().mean().backward()

        fb, update = graphs.StepGraph(fwd_bwd, stream), graphs.StepGraph(opt.step, stream)
        for i, x in enumerate(xs):
            lr.fill_(1e-2 / (i + 1))
            for p in model.parameters():
                p.grad.zero_()
            fb(x)
            update()
    torch.cuda.synchronize()
    assert fb.captured and update.captured
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def run_reducer_threads(reducer, lanes: list, body) -> None:
    """``body(i)`` in one thread per lane, inside the lane's context; a thread's error aborts the reducer (freeing
    the others) and fails the test, as does a thread still running after 60 s. Synchronises the device after."""
    import threading

    from examples.specdec import graphs

    errors: list = []

    def worker(i: int) -> None:
        try:
            with lanes[i].context():
                body(i)
        except BaseException as e:  # noqa: BLE001 - reported below; the abort frees the other threads
            errors.append(e)
            reducer.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "reducer threads still running after 60 s"
    assert not errors, errors[0]
    graphs.synchronize([lanes[0].device])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_reducer_as_step_graph_averages_and_clips_like_eager() -> None:
    """--step-graphs: the leader's sum, average and clipping replayed as one graph give every thread, at every
    step, what the eager reducer gives (three threads on three streams of one GPU, new gradients each step)."""
    from examples.specdec.runtime import Lane, Reducer

    n, size, steps = 3, 1000, 6

    def clip(total: torch.Tensor) -> None:
        g = total[:-1]
        norm = g.norm()
        total[-1] = norm
        g.mul_(torch.clamp(1.0 / (norm + 1e-6), max=1.0))

    def run(graph: bool):
        reducer = Reducer(n, n, 1, clip, graph=graph)
        lanes = [Lane(torch.device("cuda:0"), True) for _ in range(n)]
        flats = [torch.zeros(size, device="cuda") for _ in range(n)]
        seen = [[None] * steps for _ in range(n)]

        def body(i: int) -> None:
            for s in range(steps):
                gen = torch.Generator("cuda").manual_seed(100 * s + i)
                flats[i].copy_(torch.randn(size, device="cuda", generator=gen) * (s + 1))
                reducer(i, flats[i], lanes[i])
                seen[i][s] = flats[i].clone()

        run_reducer_threads(reducer, lanes, body)
        return reducer, seen

    eager_reducer, eager = run(graph=False)
    graph_reducer, replayed = run(graph=True)
    assert eager_reducer.graph is None and graph_reducer.graph is not None and graph_reducer.graph.captured
    for i in range(n):
        for s in range(steps):
            torch.testing.assert_close(replayed[i][s], eager[i][s])
        assert not torch.equal(eager[i][0], eager[i][-1])  # new gradients every step, not one replay repeated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs streams of a GPU")
def test_eager_reducer_waits_for_every_read_of_the_last_result_before_the_next_sum() -> None:
    """``--no-step-graphs`` with several drafter threads: a thread copies the step's average out of the leader's
    ``total`` on its own stream; the leader's next sum must not overwrite ``total`` before that copy has run.
    Thread 1's stream is held back (a sleep before its first copy), so its copy runs long after the leader has
    started the next step; it must still read the first step's average (1 + 2), not the leader's next gradient
    (10). Fails if the leader writes ``total`` before waiting for the other threads' events."""
    from examples.specdec.runtime import Lane, Reducer

    dev = torch.device("cuda:0")

    class LaggingLane(Lane):
        lag = False

        def copy_into(self, dst: torch.Tensor, src: torch.Tensor, ev) -> None:
            if self.lag:
                self.lag = False
                torch.cuda._sleep(1_000_000_000)  # about half a second on this stream only
            super().copy_into(dst, src, ev)

    def run(lag: bool) -> list:
        reducer = Reducer(2, 1, 1, lambda total: None, graph=False)
        lanes = [Lane(dev, True), LaggingLane(dev, True)]
        lanes[1].lag = lag
        flats = [torch.zeros(4, device=dev) for _ in range(2)]
        seen: list = [[], []]

        def body(i: int) -> None:
            for grad in ((1.0, 2.0), (10.0, 20.0)):
                flats[i].fill_(grad[i])
                reducer(i, flats[i], lanes[i])
                seen[i].append(flats[i].clone())

        run_reducer_threads(reducer, lanes, body)
        return [[float(x[0]) for x in per_thread] for per_thread in seen]

    run(lag=False)  # first launches of every kernel (a module load waits for the whole GPU)
    assert run(lag=True) == [[3.0, 30.0], [3.0, 30.0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("keep", ["record_stream", "Lane.release"])
def test_handoff_outlives_another_threads_capture(keep: str) -> None:
    """A tensor made on a producer stream is read on a consumer stream and dropped while another thread captures a
    CUDA graph; the producer then allocates again. With ``record_stream`` the caching allocator drops the
    consumer's use (a stream use recorded while a capture is underway, on a block freed while one is underway, is
    taken to belong to the capture: ``remove_graph_stream_uses``) and gives the block straight back to the
    producer, whose next write lands in what the consumer has not read yet. ``Lane.release`` keeps the tensor
    referenced until the consumer's stream has passed an event, so the consumer reads what the producer made.
    (The trainer's target -> drafter hand-off used record_stream; with --step-graphs, other threads capture while
    batches are handed over.)"""
    import threading

    from examples.specdec.runtime import Lane

    n = 1 << 22  # 16 MiB of float32: a large-pool block of its own
    # Every kernel below runs once first: the first launch of a kernel in a process loads its module, which waits
    # for the whole GPU, so a first `x_in * 1` would wait out the consumer's sleep and read before the producer
    # writes (seen in fresh processes: (True, [1.0])). Likewise one capture: the first of a process is slow to end.
    warm = torch.cuda.Stream()
    with torch.cuda.stream(warm):
        w = torch.full((8,), 1.0, device="cuda")
        torch.cuda._sleep(1)
        torch.unique(torch.empty(8, device="cuda").fill_(2.0) * w * 1).tolist()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=warm, capture_error_mode="thread_local"):
            w.add_(1)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    consumer = Lane(torch.device("cuda"), streams=True)
    capturing, finish = threading.Event(), threading.Event()
    errors: list = []

    def capture() -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                static = torch.zeros(8, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                static.add_(1)
                capturing.set()
                finish.wait(60)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            capturing.set()

    with torch.cuda.stream(producer):
        x = torch.full((n,), 1.0, device="cuda")
    address = x.data_ptr()
    made = torch.cuda.Event()
    made.record(producer)
    thread = threading.Thread(target=capture)
    thread.start()
    assert capturing.wait(60)
    with consumer.context():
        (x_in,) = consumer.fetch([x], made)
        torch.cuda._sleep(1_000_000_000)  # about half a second: the read below runs after the producer's next write
        y = x_in * 1
        if keep == "record_stream":
            x_in.record_stream(consumer.stream)
        else:
            consumer.release([x_in])
    del x, x_in
    finish.set()
    thread.join(60)
    assert not errors, errors[0]
    with torch.cuda.stream(producer):
        z = torch.empty(n, device="cuda")
        z.fill_(2.0)
    reused = z.data_ptr() == address
    torch.cuda.synchronize()
    read = torch.unique(y).tolist()
    if keep == "record_stream":
        # What upstream does (the reason the trainer no longer uses record_stream for hand-offs); if a torch
        # release keeps the use, this fails, and docs/trainer.md should say from which version.
        assert reused and read == [2.0], (reused, read)
    else:
        assert not reused and read == [1.0], (reused, read)


def test_captured_step_graph_copies_inputs_then_replays() -> None:
    """After capture (a stand-in graph here: CPU), each call copies the new tensor inputs into the static ones in
    one call (``None`` inputs skipped) and replays; a graph without inputs (the optimizer update) just replays."""
    from examples.specdec import graphs

    class Replays:
        count = 0

        def replay(self) -> None:
            self.count += 1

    with_inputs = graphs.StepGraph(lambda x, y, z: None, stream=object(), warmup=0)
    with_inputs.graph, with_inputs.static = Replays(), [torch.zeros(2), torch.zeros(3, dtype=torch.long)]
    with_inputs(torch.ones(2), None, torch.arange(3))
    assert torch.equal(with_inputs.static[0], torch.ones(2)) and torch.equal(with_inputs.static[1], torch.arange(3))
    without = graphs.StepGraph(lambda: None, stream=object(), warmup=0)
    without.graph = Replays()
    without()
    assert with_inputs.graph.count == 1 and without.graph.count == 1


def test_markov_block_is_made_outside_the_lock_and_read_ahead() -> None:
    """A block in the making does not hold up threads that need other blocks; a read-ahead never waits for a block
    another thread is making; a block evicted while it was made is still handed to its maker, never half-made."""
    import threading

    data = data_mod.MarkovData(97, 3, 300, seed=5, block=4)
    alone = data_mod.MarkovData(97, 3, 300, seed=5, block=1)
    gate, entered = threading.Event(), threading.Event()
    make = data.batches

    def slow_batches(indices):
        if indices[0] == 4:  # block 1 waits until released
            entered.set()
            assert gate.wait(10)
        return make(indices)

    data.batches = slow_batches  # type: ignore[method-assign]
    got = {}
    maker = threading.Thread(target=lambda: got.__setitem__(4, data.batch(4)))
    maker.start()
    assert entered.wait(10)
    assert data._block(1, wait=False) is None  # in the making: a read-ahead returns at once
    data.cached_blocks = 1
    assert torch.equal(data.batch(1).tokens, alone.batch(1).tokens)  # block 0 is made meanwhile (evicts block 1)
    gate.set()
    maker.join(10)
    assert not maker.is_alive()
    assert torch.equal(got[4].packed, alone.batch(4).packed)
    data.cached_blocks = 4
    assert torch.equal(data.batch(6).packed, alone.batch(6).packed)  # offset 2 of block 1: reads block 2 ahead
    assert 2 in data._cache and isinstance(data._cache[2], list)


def test_markov_cache_stays_bounded_under_racing_threads() -> None:
    """However threads race for blocks (a block evicted while being made, then made again by a waiter), the cache
    never holds more than ``cached_blocks`` blocks. Thread switches are forced often to make the races happen."""
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(50):
            data = data_mod.MarkovData(97, 3, 300, seed=5, block=4)
            threads = [threading.Thread(target=data.batch, args=(i,))
                       for i in (9, 0, 3, 17, 4, 16, 2, 30, 1, 5, 6, 7, 8, 12, 25)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(data._cache) <= data.cached_blocks
    finally:
        sys.setswitchinterval(old)


def test_machine_read_lines_are_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """SUMMARY and PARAM_CHECKSUM lines reach stdout in one write: torchrun's ranks share stdout, and print() writes
    a line's text and its newline separately, so another rank's line could land between them."""
    from examples.specdec import metrics

    writes: list = []

    class Recorder:
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Recorder())
    metrics.emit_line("PARAM_CHECKSUM rank=0 1.0000000000e+00")
    assert writes == ["PARAM_CHECKSUM rank=0 1.0000000000e+00\n"]


def _green_contexts() -> bool:
    from examples.specdec.runtime import sm_limit_problem  # the trainer's own check: torch build, driver library, SM count

    return torch.cuda.is_available() and sm_limit_problem(torch.device("cuda"), 1) is None


@pytest.mark.skipif(not _green_contexts(), reason="needs a GPU and torch built with CUDA green contexts")
def test_target_sms_stream_runs_eager_compiled_and_graphed_work() -> None:
    """--target-sms: a stream confined to some SMs (runtime.partition_stream) runs eager kernels, compiled code and
    a CUDA graph captured on it with the results of a plain stream; the SM count is checked against the GPU's.
    (That the work stays on those SMs was measured, not asserted: docs/results/trainer-h200-sm-partition.md, run M1.)"""
    from examples.specdec.runtime import Lane, sm_limit_problem

    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    assert "not in [1" in (sm_limit_problem(dev, total) or "")
    assert sm_limit_problem(dev, total // 4) is None
    lane = Lane(dev, streams=True, high_priority=True, num_sms=total // 4)
    x = torch.randn(512, 256, device=dev)
    w = torch.randn(256, 256, device=dev) / 16

    def fn(a: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(a @ w) @ w

    compiled = torch.compile(fn)
    expected = fn(x)
    torch.cuda.synchronize()
    with lane.context():
        eager, comp = fn(x), compiled(x)
        compiled(x)
        lane.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=lane.stream, capture_error_mode="thread_local"):
            static = compiled(x)
        graph.replay()
    lane.stream.synchronize()
    for got in (eager, comp, static):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)  # TF32 if another test set it


def test_step_statistics_travel_by_name_behind_the_gradients() -> None:
    """stats.Layout places the measured statistics right behind the gradients and the ones set on the average
    after them; a batch's packed values land in the measured slice, and the host copy unpacks to the same names."""
    from examples.specdec import stats

    k, n_grad = 3, 10
    layout = stats.Layout(n_grad, k)
    flat = torch.zeros(layout.size)
    flat[layout.measured].add_(stats.pack(loss=torch.tensor(2.5), acc=torch.tensor([0.5, 0.25, 0.125])))
    layout.field(flat, "grad_norm").copy_(torch.tensor(7.0))
    assert layout.measured.start == n_grad and torch.equal(layout.grads(flat), torch.zeros(n_grad))
    got = layout.unpack(layout.stats(flat).tolist())
    assert got == stats.StepStats(loss=2.5, acc=(0.5, 0.25, 0.125), grad_norm=7.0)
    assert got.record() == {"loss": 2.5, "acc": [0.5, 0.25, 0.125], "grad_norm": 7.0}
    with pytest.raises(TypeError, match="measured statistics"):
        stats.pack(loss=torch.tensor(1.0))
