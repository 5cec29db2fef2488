"""DSpark-style block drafter: packed multi-anchor training computes exactly what one-anchor drafting computes
at inference; the sequential bias changes sampling as specified; the confidence target is the exact
acceptance probability; sequential temperature scaling lowers held-out ECE on a miscalibrated case."""

import pytest
import torch

from draftsmith.drafters import dspark as dsp
from draftsmith.drafters import ttt_attention
from draftsmith.drafters.calibration import fit_sequential_scaling, survival_ece
from draftsmith.drafters.dspark import DSparkConfig, DSparkDrafter
from draftsmith.drafters.losses import teacher_from_final
from draftsmith.drafters.objectives import DSparkObjectiveSettings, dspark_objective, sample_anchors
from draftsmith.drafters.vocab import draft_to_target_ids, select_draft_vocab
from draftsmith.eval.sampling import make_generator

V, D, H, HT = 97, 41, 32, 24


def _drafter(num_layers=2, markov_rank=16, dtype=torch.float64, seed=0, block_size=4, device="cpu"):
    """A random drafter, initialized on the CPU (the same weights on every device) and then moved to `device`."""
    torch.manual_seed(seed)
    cfg = DSparkConfig(
        vocab_size=V,
        draft_vocab_size=D,
        hidden_size=H,
        target_hidden_size=HT,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        aux_layer_ids=[1, 2, 3],
        mask_token_id=V - 1,
        block_size=block_size,
        num_layers=num_layers,
        markov_rank=markov_rank,
    )
    model = DSparkDrafter(cfg).to(dtype).eval()
    d2t, t2d = select_draft_vocab(torch.rand(V), D)
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norms so a wrong normalization path cannot hide
                p.uniform_(0.5, 1.5)
        if model.markov_head is not None:
            model.markov_head.markov_w1.weight.normal_(0, 1.0)  # a bias large enough to matter
    return model.to(device)


@pytest.mark.parametrize("variant", [dict(), dict(num_layers=1, markov_rank=0), dict(block_size=1)])
def test_packed_multi_anchor_forward_equals_one_anchor_inference(variant, test_device):
    model = _drafter(**variant, device=test_device)
    G = model.config.block_size
    B, T = 2, 15
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(B, T, 3 * HT, generator=g, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, V - 1, (B, T), generator=g).to(test_device)
    attention = torch.ones(B, T, dtype=torch.bool, device=test_device)
    attention[1, 11:] = False  # a shorter second sequence (right padding)
    anchors = torch.tensor([[0, 3, 7, 9], [2, 5, 6, 10]], device=test_device)
    with torch.no_grad():
        logits, conf, prev = model(aux, ids, attention, anchors)
    for b in range(B):
        for a, p in enumerate(anchors[b].tolist()):
            cache = model.new_cache()
            if p > 0:
                model.extend_context(cache, aux[b : b + 1, :p], torch.arange(p, device=test_device).unsqueeze(0))
            h, base = model.draft_block(cache, ids[b : b + 1, p], torch.tensor([p], device=test_device))
            for k in range(G):
                x_prev = ids[b, min(p + k, T - 1)]  # teacher-forced previous token (the anchor for k = 0)
                lk, ck = model.heads(h[:, k], x_prev.view(1), base[:, k])
                torch.testing.assert_close(lk[0], logits[b, a, k], rtol=0, atol=1e-10)
                torch.testing.assert_close(ck[0], conf[b, a, k], rtol=0, atol=1e-10)
                assert prev[b, a, k] == x_prev


def test_packed_forward_would_differ_if_blocks_saw_each_other(test_device):
    """Guard: with the packed mask opened across blocks the logits change, so the equality above is not vacuous."""
    model = _drafter(device=test_device)
    aux = torch.randn(1, 12, 3 * HT, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, V - 1, (1, 12)).to(test_device)
    att = torch.ones(1, 12, dtype=torch.bool, device=test_device)
    anchors = torch.tensor([[2, 6]], device=test_device)
    with torch.no_grad():
        together = model(aux, ids, att, anchors)[0][0, 1]
        alone = model(aux, ids, att, anchors[:, 1:])[0][0, 0]
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-10)
    with torch.no_grad():  # a context that includes the anchor's own position is a different computation
        shifted = model(aux, ids, att, anchors[:, 1:] + 1)[0][0, 0]
    assert (shifted - alone).abs().max() > 1e-3


def test_sequential_bias_is_W1_of_previous_token_times_W2_and_moves_sampling(test_device):
    model = _drafter(device=test_device)
    h = torch.randn(1, H, dtype=torch.float64).to(test_device)
    base = model.lm_head(h)
    a, b = torch.tensor([5], device=test_device), torch.tensor([17], device=test_device)
    la, _ = model.heads(h, a, base)
    lb, _ = model.heads(h, b, base)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    torch.testing.assert_close(la - base, (w1[5] @ w2.T)[None], rtol=0, atol=1e-12)
    torch.testing.assert_close(lb - base, (w1[17] @ w2.T)[None], rtol=0, atol=1e-12)
    # the distribution sampled from depends on the previous token: a chi-square-free check on exact probabilities
    pa, pb = torch.softmax(la, -1), torch.softmax(lb, -1)
    assert 0.5 * (pa - pb).abs().sum() > 0.05
    # and sampling follows the biased distribution (frequency check over many draws)
    gen = make_generator(test_device, 0)  # multinomial on a device takes a generator of that device
    draws = torch.multinomial(pa[0].float(), 20000, replacement=True, generator=gen)
    freq = torch.bincount(draws, minlength=D).double() / 20000
    assert (freq - pa[0]).abs().max() < 0.02


def test_training_time_test_mode_conditions_on_the_drafters_own_samples(test_device):
    model = _drafter(device=test_device)
    aux = torch.randn(1, 12, 3 * HT, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, V - 1, (1, 12)).to(test_device)
    att = torch.ones(1, 12, dtype=torch.bool, device=test_device)
    anchors = torch.tensor([[3]], device=test_device)
    with torch.no_grad():
        logits, _, prev = model(aux, ids, att, anchors, sample_temperature=0.0)
    draft_ids = draft_to_target_ids(model.d2t)
    assert prev[0, 0, 0] == ids[0, 3]
    for k in range(1, model.config.block_size):  # greedy: slot k conditions on slot k-1's argmax
        assert prev[0, 0, k] == draft_ids[logits[0, 0, k - 1].argmax()]


def test_confidence_target_is_the_exact_acceptance_probability(test_device):
    """The BCE target at T>0 equals Σ_x min(p(x), q(x)) over the FULL target vocabulary = 1 - TV(p, q)."""
    torch.manual_seed(0)
    model = _drafter(device=test_device)
    draft_ids = draft_to_target_ids(model.d2t)
    head = torch.randn(V, H, dtype=torch.float64).to(test_device)
    final = torch.randn(1, 3, H, dtype=torch.float64).to(test_device)
    logits = torch.randn(1, 3, D, dtype=torch.float64).to(test_device)
    T = 0.7
    teacher = teacher_from_final(final, head, draft_ids, T)
    from draftsmith.drafters.losses import acceptance

    alpha = acceptance(logits, teacher, draft_ids, T)
    p = torch.softmax((final @ head.T) / T, -1)  # full vocabulary
    q = torch.zeros_like(p)
    q[..., draft_ids] = torch.softmax(logits / T, -1)
    torch.testing.assert_close(alpha.double(), 1 - 0.5 * (p - q).abs().sum(-1), rtol=0, atol=1e-6)


def _batch(B=2, T=20, seed=0):
    """A batch as the loader gives it: on the CPU (the objectives move it to the device of the head)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.uint8)
    mask[:, 6:] = 1
    return {
        "input_ids": torch.randint(0, V - 1, (B, T), generator=g),
        "loss_mask": mask,
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "aux": torch.randn(B, T, 3 * HT, generator=g),
        "final": torch.randn(B, T, H, generator=g),
        "ids": [f"s{i}" for i in range(B)],
        "domains": ["test"] * B,
        "epoch": 0,
    }


def test_anchors_are_supervised_positions_redrawn_per_epoch_and_reproducible(test_device):
    batch = _batch()
    att, loss_mask = batch["attention_mask"].to(test_device), batch["loss_mask"].to(test_device)  # as the objective
    a0, v0 = sample_anchors(loss_mask, att, batch["ids"], 5, seed=0, epoch=0)
    again, _ = sample_anchors(loss_mask, att, batch["ids"], 5, seed=0, epoch=0)
    a1, _ = sample_anchors(loss_mask, att, batch["ids"], 5, seed=0, epoch=1)
    # the draw is the CPU generator's: the same anchors whatever the device (and so on every rank of a mixed run)
    on_cpu, _ = sample_anchors(batch["loss_mask"], batch["attention_mask"], batch["ids"], 5, seed=0, epoch=0)
    assert a0.device.type == test_device.type and torch.equal(a0.cpu(), on_cpu)
    assert torch.equal(a0, again) and not torch.equal(a0, a1)
    assert v0.all() and (a0 >= 5).all() and (a0 <= 18).all()  # next token (p+1) supervised and inside the sequence
    few, valid = sample_anchors(loss_mask, att, batch["ids"], 100, seed=0, epoch=0)
    assert valid.sum(1).tolist() == [14, 14]  # every candidate once, no duplicates
    assert all(len(set(r[v].tolist())) == 14 for r, v in zip(few, valid))


def test_anchors_are_a_uniform_draw_without_replacement_of_a_fixed_width(test_device):
    """Every subset of `count` candidates is as likely (each candidate 3/10, each pair 3/10 * 2/9), none twice; the
    width A = min(count, T-1) does not depend on the data, so drawing reads nothing back from the device."""
    T, n = 16, 4000
    loss_mask = torch.zeros(n, T, dtype=torch.uint8)
    loss_mask[:, 4:14] = 1  # candidates: p = 3..12 (p+1 supervised)
    att = torch.ones(n, T, dtype=torch.bool)
    ids = [f"s{i}" for i in range(n)]
    anchors, valid = sample_anchors(loss_mask.to(test_device), att.to(test_device), ids, 3, seed=0, epoch=0)
    anchors, valid = anchors.cpu(), valid.cpu()
    assert anchors.shape == (n, 3) and valid.all()
    assert ((anchors >= 3) & (anchors <= 12)).all() and (anchors.diff(dim=1) > 0).all()  # sorted, distinct
    once = torch.zeros(T).index_add_(0, anchors.flatten(), torch.ones(3 * n)) / n
    assert (once[3:13] - 0.3).abs().max() < 0.04, once  # 5 sigma
    pairs = torch.zeros(T, T)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        pairs.index_put_((anchors[:, a], anchors[:, b]), torch.ones(n), accumulate=True)
    in_pairs = pairs[3:13, 3:13][torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)] / n
    assert (in_pairs - 1 / 15).abs().max() < 0.022, in_pairs  # 5 sigma
    wide, wide_valid = sample_anchors(loss_mask[:2], att[:2], ids[:2], 100, seed=0, epoch=0)
    assert wide.shape == (2, T - 1) and wide_valid.sum(1).tolist() == [10, 10]  # padding after the 10 candidates
    assert (wide[~wide_valid] == 0).all() and not wide_valid[:, 10:].any()


def test_objective_trains_and_reports_per_slot_statistics(test_device):
    model = _drafter(dtype=torch.float32, device=test_device).train()
    head = torch.randn(V, H).to(test_device)
    s = DSparkObjectiveSettings(block_size=4, anchors_per_sequence=6, temperature=1.0)
    batch = _batch()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(60):
        loss, stats = dspark_objective(model, batch, head, s)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.7 * first
    anchors, _ = sample_anchors(batch["loss_mask"], batch["attention_mask"], batch["ids"], 6, 0, 0)
    for k in range(4):  # slot k of anchor p counts while the token it predicts (p+k+1) is inside the sequence
        assert stats[f"n_{k}"] == int((anchors + k + 1 <= 19).sum())
    assert stats["tau_n"] == 12
    assert 1.0 <= stats["tau"] / stats["tau_n"] <= 5.0


def _miscalibrated(n, seed, scale, shift, device):
    """Confidence logits `scale` times the true acceptance logit plus `shift`, with 0/1 acceptances drawn from the
    true chance (on the CPU, then moved where the test runs)."""
    g = torch.Generator().manual_seed(seed)
    true_logit = torch.randn(n, 5, generator=g, dtype=torch.float64) + 1.0
    alpha = torch.bernoulli(torch.sigmoid(true_logit), generator=g)
    valid = torch.ones(n, 5, dtype=torch.bool)
    return (scale * true_logit + shift).to(device), alpha.to(device), valid.to(device)


def test_sequential_scaling_lowers_heldout_ece(test_device):
    """Confidences that are systematically over-confident (logits 3x too large) get temperatures > 1, biases near 0,
    and a lower survival ECE on fresh data from the same process (fitted where the data is)."""
    conf, alpha, valid = _miscalibrated(4000, 0, 3.0, 0.0, test_device)
    temps, biases = fit_sequential_scaling(conf, alpha, valid)
    assert all(2.0 < t < 4.5 for t in temps[:2]), temps
    assert all(abs(b) < 0.3 for b in biases[:2]), biases
    c2, a2, v2 = _miscalibrated(4000, 1, 3.0, 0.0, test_device)
    before = survival_ece(c2, a2, v2, [1.0] * 5)
    after = survival_ece(c2, a2, v2, temps, biases=biases)
    assert all(x < 0.25 * y for x, y in zip(after, before)), (before, after)
    assert max(after) < 0.04


def test_sequential_scaling_calibrates_a_head_biased_toward_acceptance(test_device):
    """A head whose logits are shifted up (it learned on answers its drafter fits better than the holdout, as the
    demo's EAGLE-3 head did) predicts above what is accepted at every temperature: a temperature alone can only pull
    the predictions toward 1/2, and leaves the survival ECE high. The bias takes the shift out."""
    conf, alpha, valid = _miscalibrated(4000, 0, 1.0, 3.0, test_device)
    temps, biases = fit_sequential_scaling(conf, alpha, valid)
    assert -3.6 < biases[0] < -2.4, biases
    c2, a2, v2 = _miscalibrated(4000, 1, 1.0, 3.0, test_device)
    after = survival_ece(c2, a2, v2, temps, biases=biases)
    assert max(after) < 0.04, after
    # the best a temperature alone can do here (a grid over 0.03-30) stays far worse at the first position
    alone = min(survival_ece(c2, a2, v2, [t] + temps[1:], biases=[0.0] + biases[1:])[0] for t in (0.1, 1, 3, 10, 30))
    assert alone > 3 * after[0], (alone, after[0])


def test_sampled_markov_inputs_supervise_a_slot_only_while_its_conditioning_matches_the_data(test_device):
    """With sample_markov_inputs, slot k is conditioned on the drafter's own samples; its teacher (the target after
    the data prefix) is only right while those samples equal the data tokens, so later slots are masked."""
    from draftsmith.drafters.objectives import _dspark_forward

    model = _drafter(dtype=torch.float32, device=test_device)
    batch = _batch()
    head = torch.randn(V, H).to(test_device)
    on_device = {k: v.to(test_device) for k, v in batch.items() if torch.is_tensor(v)}  # for the direct forward
    forced = DSparkObjectiveSettings(block_size=4, anchors_per_sequence=6, temperature=0.0)
    sampled = DSparkObjectiveSettings(block_size=4, anchors_per_sequence=6, temperature=0.0, sample_markov_inputs=True)
    with torch.no_grad():
        _, _, _, valid_forced, _ = _dspark_forward(model, batch, head, forced, model)
        logits, _, _, valid, _ = _dspark_forward(model, batch, head, sampled, model)
        _, _, prev = model(
            on_device["aux"],
            on_device["input_ids"],
            on_device["attention_mask"],
            sample_anchors(on_device["loss_mask"], on_device["attention_mask"], batch["ids"], 6, 0, 0)[0],
            0.0,
        )
    G = 4
    anchors, _ = sample_anchors(on_device["loss_mask"], on_device["attention_mask"], batch["ids"], 6, 0, 0)
    data_prev = (
        on_device["input_ids"]
        .gather(1, (anchors[..., None] + torch.arange(G, device=test_device)).clamp_max(19).view(2, -1))
        .view(2, -1, G)
    )
    matches = (prev == data_prev).long().cumprod(-1).bool().view(2, -1)
    assert valid_forced.view(2, -1, G)[..., 1:].any()  # teacher-forced: later slots are supervised
    assert torch.equal(valid, valid_forced & matches)  # sampled: only while every earlier sample was the data token
    assert (~matches.view(2, -1, G)[..., 1:]).any()  # a random drafter's samples do differ: the test has power
    # the statistics count only those slots
    _, stats = dspark_objective(model, batch, head, sampled)
    for k in range(G):
        assert stats[f"n_{k}"] == int(valid.view(2, -1, G)[..., k].sum())


# ------------------------------------------------------------------------------ packed training attention


def _packed_inputs(heads, kv_heads, A, G, dtype, device="cpu", T=13, d=8, seed=0):
    """Random slots q [2, heads, A*G, d], context and block keys/values [2, kv_heads, T | A*G, d] (leaves with
    grad), and the packing: row 0 has anchors at 0 and T-1 (an empty context and the longest one); row 1 is
    right-padded (its last 4 tokens are padding) with an anchor near the end that would see the padded tokens,
    a hole in its attention mask, and padding anchors (0) after its real ones."""
    g = torch.Generator().manual_seed(seed)

    def leaf(h, n):
        return torch.randn(2, h, n, d, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()

    q = leaf(heads, A * G)
    ck, cv, bk, bv = leaf(kv_heads, T), leaf(kv_heads, T), leaf(kv_heads, A * G), leaf(kv_heads, A * G)
    anchors = torch.randint(0, T, (2, A), generator=g)
    anchors[0, 0], anchors[0, -1] = 0, T - 1
    anchors[1] = torch.sort(anchors[1]).values
    anchors[1, A // 2 :] = 0  # padding anchors
    anchors[1, max(0, A // 2 - 1)] = T - 2
    real = torch.ones(2, T, dtype=torch.bool)
    real[1, T - 4 :] = False
    real[1, 3] = False
    packed = dsp.PackedBlocks(anchors.to(device), real.to(device), G)
    return (q, ck, cv, bk, bv), packed


def _run_packed(fn, leaves, packed, grad_seed=1):
    """fn's output and every input's gradient under a fixed random upstream gradient."""
    for x in leaves:
        x.grad = None
    out = fn(*leaves, packed, 0.35)
    g = torch.Generator().manual_seed(grad_seed)
    (out * torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)).sum().backward()
    return [out.detach()] + [x.grad.clone() for x in leaves]


def _double(leaves):
    return [x.detach().double().requires_grad_() for x in leaves]


PACKED_NAMES = ["output", "grad q", "grad context k", "grad context v", "grad block k", "grad block v"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("A,G,chunk", [(1, 1, None), (2, 4, 1), (5, 3, 2), (7, 2, 3), (6, 4, None)])
def test_chunked_packed_attention_equals_the_reference(dtype, heads, kv_heads, A, G, chunk):
    """Outputs and the gradients of every input. fp64 and fp32 against the reference directly; bf16 against the
    float64 result on the same (rounded) inputs, which the reference (bf16 SDPA) and the chunked path (fp32
    throughout) both approximate: the chunked path must be at least about as close as the reference."""
    leaves, packed = _packed_inputs(heads, kv_heads, A, G, dtype)
    new = _run_packed(lambda *a: dsp.chunked_packed_attention(*a, chunk=chunk), leaves, packed)
    ref = _run_packed(dsp.packed_attention_reference, leaves, packed)
    exact = _run_packed(dsp.packed_attention_reference, _double(leaves), packed)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6}.get(dtype)
    for name, n, r, e in zip(PACKED_NAMES, new, ref, exact):
        assert n.dtype == dtype, name
        if tol is not None:
            torch.testing.assert_close(n, r, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
        else:
            err_new, err_ref, top = (n.double() - e).abs().max(), (r.double() - e).abs().max(), e.abs().max()
            assert err_new <= 1.25 * err_ref + 2**-8 * top and err_new <= 0.01 * top, (name, err_new, err_ref)


def test_chunked_packed_attention_gradcheck():
    leaves, packed = _packed_inputs(4, 2, 3, 2, torch.float64, T=6, d=3)
    fn = lambda *a: dsp.chunked_packed_attention(*a, packed, 0.7, chunk=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(leaves), eps=1e-6, atol=1e-7)


def _visible_keys(attend, packed):
    """[B, A*G, T + A*G]: which keys ([context; blocks]) each slot's output draws on, read off the attention
    itself: zero queries weigh every visible key alike, and each key's value is the one-hot of its index."""
    B, Q, T = packed.anchors.shape[0], packed.slots, packed.context_length
    n = T + Q
    eye = torch.eye(n, dtype=torch.float64).expand(B, 1, n, n)
    q, zeros = torch.zeros(B, 1, Q, n, dtype=torch.float64), torch.zeros(B, 1, n, n, dtype=torch.float64)
    out = attend(q, zeros[:, :, :T], eye[:, :, :T], zeros[:, :, T:], eye[:, :, T:], packed, 1.0)
    return out[:, 0] > 0


@pytest.mark.parametrize("A,G", [(1, 1), (3, 4), (6, 2)])
def test_the_masks_of_every_path_are_the_references(A, G):
    """The reference's mask is the specification (each slot: context keys before its anchor that are real tokens,
    and its own block); flex_attention's mask_mod evaluated over all (slot, key) pairs, and the keys the chunked
    path's output actually draws on, are that mask."""
    from torch.nn.attention.flex_attention import create_mask

    _, packed = _packed_inputs(1, 1, A, G, torch.float64)
    T, Q = packed.context_length, packed.slots
    expected = torch.zeros(2, Q, T + Q, dtype=torch.bool)
    for b in range(2):
        for s in range(Q):
            a = s // G
            for t in range(T):
                expected[b, s, t] = t < packed.anchors[b, a] and packed.real[b, t]
            expected[b, s, T + a * G : T + (a + 1) * G] = True
    assert torch.equal(packed.dense_mask()[:, 0], expected)
    assert torch.equal(_visible_keys(dsp.packed_attention_reference, packed), expected)
    flex = create_mask(packed.mask_mod(), 2, 1, Q, T + Q, device="cpu")[:, 0]
    assert torch.equal(flex, expected)
    for chunk in (1, 2, None):
        chunked = _visible_keys(lambda *a, chunk=chunk: dsp.chunked_packed_attention(*a, chunk=chunk), packed)
        assert torch.equal(chunked, expected), chunk


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("A,G", [(3, 4), (7, 2)])
def test_flex_packed_attention_eagerly_on_cpu_equals_the_reference(heads, kv_heads, A, G):
    """flex_attention eagerly on the CPU (forward only: no CPU backward) with this batch's block mask, as the
    CUDA path compiles it."""
    leaves, packed = _packed_inputs(heads, kv_heads, A, G, torch.float64)
    leaves = [x.detach() for x in leaves]
    with torch.no_grad():
        ref = dsp.packed_attention_reference(*leaves, packed, 0.35)
        out = dsp.flex_packed_attention(*leaves, packed, 0.35, compiled=False)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_chunked_packed_attention_keeps_memory_linear_in_the_anchors():
    """What autograd keeps for backward grows linearly in A with the chunked path (by the same amount for each
    added anchor) and faster with the reference (its mask is A*G x (T + A*G)). Counted with saved-tensor hooks."""

    def saved(fn, A):
        leaves, packed = _packed_inputs(4, 2, A, 4, torch.float32, T=64)
        sizes = []

        def pack(x):
            sizes.append(x.numel())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn(*leaves, packed, 0.35)
        return sum(sizes)

    chunked = lambda *a: dsp.chunked_packed_attention(*a, chunk=4)  # noqa: E731
    c = [saved(chunked, A) for A in (32, 64, 128)]
    assert c[2] - c[1] == 2 * (c[1] - c[0])
    r = [saved(dsp.packed_attention_reference, A) for A in (32, 64, 128)]
    assert r[2] - r[1] > 2.5 * (r[1] - r[0])


def test_default_anchor_chunk_keeps_a_chunks_scores_in_budget(monkeypatch):
    """As many anchors per chunk as keep B x heads x chunk x G x T scores at CHUNK_ELEMENTS, at least 1, at most A."""
    assert dsp.default_anchor_chunk(2, 4, 2, 10, 5) == 5
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", 2 * 4 * 2 * 10 * 3)
    assert dsp.default_anchor_chunk(2, 4, 2, 10, 5) == 3 and dsp.default_anchor_chunk(2, 4, 2, 10, 2) == 2


@pytest.mark.parametrize("impl", ["reference", "chunked", "auto"])
def test_packed_forward_through_each_attention_path_equals_one_anchor_inference(impl, test_device, monkeypatch):
    """The packed forward == inference check above, through each path (chunked: 3 anchors per chunk of 4, so a
    chunk boundary falls inside a row; auto: the device's default, flex_attention on CUDA)."""
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", 2 * 4 * 4 * 15 * 3)
    with ttt_attention.use_impl(impl):
        test_packed_multi_anchor_forward_equals_one_anchor_inference({}, test_device)


def test_parameter_gradients_are_the_same_through_every_attention_path(test_device, monkeypatch):
    """A training step's parameter gradients through the chunked path (2 anchors per chunk) and the device's
    default equal those through the dense reference; padded tokens and padding anchors included."""
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", 2 * 4 * 4 * 15 * 2)
    model = _drafter(device=test_device).train()
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(2, 15, 3 * HT, generator=g, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, V - 1, (2, 15), generator=g).to(test_device)
    att = torch.ones(2, 15, dtype=torch.bool, device=test_device)
    att[1, 10:] = False
    anchors = torch.tensor([[0, 4, 8, 14, 11], [3, 9, 13, 0, 0]], device=test_device)
    grads = {}
    for impl in ("reference", "chunked", "auto"):
        model.zero_grad()
        with ttt_attention.use_impl(impl):
            logits, conf, _ = model(aux, ids, att, anchors)
        (logits.square().mean() + conf.mean()).backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert "fc.weight" in grads["reference"] and "layers.0.self_attn.k_proj.weight" in grads["reference"]
    for impl in ("chunked", "auto"):
        assert grads[impl].keys() == grads["reference"].keys()
        for n, gr in grads[impl].items():
            torch.testing.assert_close(gr, grads["reference"][n], rtol=1e-9, atol=1e-11, msg=f"{impl}: {n}")


def test_the_packed_path_is_chosen_where_ttt_attention_chooses(monkeypatch):
    """One switch for both drafters' training attention: use_impl / $DRAFTSMITH_TTT_ATTENTION; on the CPU the
    default is the chunked path."""
    monkeypatch.delenv(ttt_attention.ENV_VAR, raising=False)
    leaves, packed = _packed_inputs(4, 2, 3, 2, torch.float64)
    called = []
    for name in ("packed_attention_reference", "chunked_packed_attention", "flex_packed_attention"):
        monkeypatch.setattr(dsp, name, lambda *a, name=name: called.append(name) or a[0])
    dsp.packed_block_attention(*leaves, packed, 0.35)
    with ttt_attention.use_impl("reference"):
        dsp.packed_block_attention(*leaves, packed, 0.35)
    monkeypatch.setenv(ttt_attention.ENV_VAR, "flex")
    dsp.packed_block_attention(*leaves, packed, 0.35)
    assert called == ["chunked_packed_attention", "packed_attention_reference", "flex_packed_attention"]


def test_sampled_markov_inputs_are_drawn_per_sequence_not_from_the_global_generator(test_device):
    """At T > 0 the sampled training-time test draws each slot's token at a uniform seeded by (seed, epoch, sequence):
    the holdout, the calibration and a resumed run see the same draws whatever the global generator did before, and a
    sequence draws the same tokens alone or in a batch (so on any rank count). Drawn from the global generator (the
    defect), both comparisons fail."""
    from draftsmith.drafters.objectives import _dspark_forward

    model = _drafter(dtype=torch.float32, device=test_device)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1)).to(test_device)
    s = DSparkObjectiveSettings(block_size=4, anchors_per_sequence=6, temperature=1.0, sample_markov_inputs=True)
    both, alone = _batch(), _batch()
    alone = {k: (v[1:] if torch.is_tensor(v) or isinstance(v, list) else v) for k, v in alone.items()}
    outs = []
    with torch.no_grad():
        for seed, batch in ((1, both), (2, both), (3, alone)):
            torch.manual_seed(seed)
            if test_device.type == "cuda":
                torch.cuda.manual_seed_all(seed)
            outs.append(_dspark_forward(model, batch, head, s, model))
    (l1, _, _, v1, _), (l2, _, _, v2, _), (l3, _, _, v3, _) = outs
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    assert torch.equal(v1, v2)
    torch.testing.assert_close(l1[1:], l3, rtol=1e-5, atol=1e-5)  # (a batch of one may take other kernels)
    assert torch.equal(v1[1:], v3)
    # the draws differ between epochs (a new draw each epoch, as the anchors), and with the data somewhere: power
    with torch.no_grad():
        l4, _, _, v4, _ = _dspark_forward(model, {**both, "epoch": 1}, head, s, model)
    assert not torch.equal(v1, v4) or not torch.equal(l1, l4)


def test_sampling_at_a_temperature_without_uniforms_is_refused(test_device):
    model = _drafter(dtype=torch.float32, device=test_device)
    b = {k: (v.to(test_device) if torch.is_tensor(v) else v) for k, v in _batch().items()}
    anchors = torch.tensor([[6, 8], [7, 9]], device=test_device)
    with pytest.raises(ValueError, match="needs uniforms of shape"):
        model(b["aux"], b["input_ids"], b["attention_mask"], anchors, 1.0)


def test_survival_ece_is_none_where_no_block_reaches_a_position():
    """With sampled Markov inputs a position can have no valid slot in the whole holdout; its ECE is None, which the
    calibration report writes as JSON null (NaN, as it was, is not JSON: jq and JavaScript refuse the file)."""
    import json

    conf, alpha = torch.zeros(5, 3), torch.full((5, 3), 0.5)
    valid = torch.tensor([[True, True, False]] * 5)
    eces = survival_ece(conf, alpha, valid, [1.0] * 3)
    assert eces[2] is None and eces[0] is not None and eces[1] is not None
    json.dumps({"survival_ece_after": eces}, allow_nan=False)  # raises on NaN


def test_argmax_drafts_calibration_conditions_the_markov_inputs_on_the_argmax(test_device):
    """Fitting the confidences for drafts taken as the argmax at T > 0 (eval.draft_sample_method = greedy), a block's
    later slots are conditioned on the argmax, as at T = 0 (the same confidences and supervised slots), not on tokens
    drawn at T."""
    from dataclasses import replace

    from draftsmith.drafters.objectives import dspark_calibration_data

    model = _drafter(dtype=torch.float32, device=test_device)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1)).to(test_device)
    base = DSparkObjectiveSettings(block_size=4, anchors_per_sequence=6, temperature=1.0, sample_markov_inputs=True)
    with torch.no_grad():
        conf_g, alpha_g, valid_g = dspark_calibration_data(model, _batch(), head, replace(base, greedy_drafts=True))
        conf_0, _, valid_0 = dspark_calibration_data(model, _batch(), head, replace(base, temperature=0.0))
        conf_s, _, valid_s = dspark_calibration_data(model, _batch(), head, base)
    torch.testing.assert_close(conf_g, conf_0, rtol=0, atol=0)
    assert torch.equal(valid_g, valid_0)
    assert not (torch.equal(valid_s, valid_0) and torch.equal(conf_s, conf_0))  # drawn inputs condition otherwise
    assert bool(((alpha_g >= 0) & (alpha_g <= 1)).all())
