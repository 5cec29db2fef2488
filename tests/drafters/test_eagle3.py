"""EAGLE-3: training-time test computes exactly what cached autoregressive drafting computes."""

import pytest
import torch

from draftsmith.drafters import ttt_attention
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter


def _drafter(num_layers=1, norm_before_residual=False, dtype=torch.float64, seed=0, device="cpu"):
    """A random drafter, initialized on the CPU (the same weights on every device) and then moved to `device`."""
    torch.manual_seed(seed)
    cfg = Eagle3Config(
        vocab_size=97,
        draft_vocab_size=41,
        hidden_size=32,
        target_hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        aux_layer_ids=[1, 2, 3],
        num_layers=num_layers,
        norm_before_residual=norm_before_residual,
    )
    model = Eagle3Drafter(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms so a wrong normalization path cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(device)


def _batch_and_head(loss_mask, g, device):
    """A TrainBatch for `_drafter` (2 rows) around this loss mask, and a target head, drawn from `g` on the CPU."""
    B, T = loss_mask.shape
    batch = {
        "input_ids": torch.randint(0, 97, (B, T), generator=g),
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "aux": torch.randn(B, T, 3 * 24, generator=g, dtype=torch.float64),
        "final": torch.randn(B, T, 32, generator=g, dtype=torch.float64),
        "ids": ["a", "b"],
        "domains": ["x", "x"],
        "epoch": 0,
    }
    return batch, torch.randn(97, 32, generator=g, dtype=torch.float64).to(device)


@pytest.mark.parametrize("impl", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", [dict(), dict(num_layers=2), dict(norm_before_residual=True)])
def test_ttt_step_i_equals_cached_autoregressive_drafting(steps, variant, impl, test_device, monkeypatch):
    """Through each TTT attention path (drafters/ttt_attention.py): the dense reference, the chunked path (in
    chunks of 5 of the 13 slots, so a chunk boundary falls inside), and the device's default (on CUDA, flex)."""
    if impl == "auto" and test_device.type == "cpu":
        pytest.skip("on the CPU the default is the chunked path, checked above")
    model = _drafter(**variant, device=test_device)
    B, T = 2, 13
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", B * 4 * T * 5)  # 4 heads: 5 queries per chunk
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(B, T, 3 * 24, generator=g, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, 97, (B, T), generator=g).to(test_device)
    with torch.no_grad(), ttt_attention.use_impl(impl):
        outs = model.ttt_forward(aux, ids, steps)
    assert len(outs) == steps
    checked = 0
    for b in range(B):
        for t in range(T - 1):
            cache = model.new_cache()
            # the context: step-0 entries for slots 0..t, built from target features, in one cached call
            logits, conf, hidden = model.decode(
                aux[b : b + 1, : t + 1],
                ids[b : b + 1, 1 : t + 2],
                torch.arange(t + 1, device=test_device).unsqueeze(0),
                cache,
                from_target=True,
            )
            torch.testing.assert_close(logits[0, t], outs[0][0][b, t], rtol=0, atol=1e-10)
            torch.testing.assert_close(conf[0, t], outs[0][1][b, t], rtol=0, atol=1e-10)
            h = hidden[:, t : t + 1]
            for i in range(1, steps):
                if t + 1 + i >= T:
                    break
                # step i: the drafter's own previous hidden state and the next token, at position t+i
                logits, conf, h = model.decode(
                    h,
                    ids[b : b + 1, t + 1 + i : t + 2 + i],
                    torch.tensor([[t + i]], device=test_device),
                    cache,
                    from_target=False,
                )
                torch.testing.assert_close(logits[0, 0], outs[i][0][b, t], rtol=0, atol=1e-10)
                torch.testing.assert_close(conf[0, 0], outs[i][1][b, t], rtol=0, atol=1e-10)
                checked += 1
    assert checked > 0 or steps == 1


def test_heads_at_one_slot_per_row_equal_those_slots_of_the_full_heads(test_device):
    """`decode(heads_at=idx)` (a catch-up over many verified slots that needs only each row's last one) gives that
    slot's logits and confidence as the full call does, and the same hidden states, and runs the vocabulary
    projection over one slot per row (what makes a catch-up cheap)."""
    model = _drafter(device=test_device)
    B, n = 2, 9
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(B, n, 3 * 24, generator=g, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, 97, (B, n), generator=g).to(test_device)
    pos = torch.arange(n, device=test_device).expand(B, n)
    idx = torch.tensor([8, 5], device=test_device)
    projected = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _o: projected.append(args[0].shape[:-1].numel()))
    with torch.no_grad():
        full_cache, some_cache = model.new_cache(), model.new_cache()
        logits, conf, h = model.decode(aux, ids, pos, full_cache, from_target=True)
        one_logits, one_conf, one_h = model.decode(aux, ids, pos, some_cache, from_target=True, heads_at=idx)
    hook.remove()
    assert projected == [B * n, B]
    rows = torch.arange(B, device=test_device)
    torch.testing.assert_close(one_logits[:, 0], logits[rows, idx], rtol=0, atol=1e-12)
    torch.testing.assert_close(one_conf[:, 0], conf[rows, idx], rtol=0, atol=1e-12)
    torch.testing.assert_close(one_h, h, rtol=0, atol=0)


def test_ttt_would_differ_without_the_diagonal_keys(test_device):
    """Guard for the test above: dropping the diagonal keys changes step>=1 logits, so the equality is not vacuous."""
    model = _drafter(device=test_device)
    aux = torch.randn(1, 9, 72, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, 97, (1, 9)).to(test_device)
    with torch.no_grad():
        full = model.ttt_forward(aux, ids, 2)[1][0]
        attn = model.midlayer.self_attn
        real = attn.ttt
        attn.ttt = lambda x, cos, sin, past: real(x, cos, sin, past[:1] if len(past) > 1 else [])
        try:
            broken = model.ttt_forward(aux, ids, 2)[1][0]
        finally:
            attn.ttt = real
    assert (full - broken).abs().max() > 1e-3


def test_gradient_checkpointing_gives_the_same_gradients(test_device):
    model = _drafter(dtype=torch.float64, device=test_device).train()
    aux = torch.randn(2, 10, 72, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, 97, (2, 10)).to(test_device)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        outs = model.ttt_forward(aux, ids, 3, checkpoint=ckpt)
        sum(o[0].square().mean() + o[1].mean() for o in outs).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "fc.weight" in grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n])
    assert "embed_tokens.weight" not in grads[0]  # frozen


def test_ttt_gradients_are_the_same_through_every_attention_path(test_device, monkeypatch):
    """The training step's parameter gradients through the chunked TTT attention (chunks of 4 of the 11 slots) and
    through the device's default equal those through the dense reference."""
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", 2 * 4 * 11 * 4)
    model = _drafter(num_layers=2, dtype=torch.float64, device=test_device).train()
    aux = torch.randn(2, 11, 72, dtype=torch.float64).to(test_device)
    ids = torch.randint(0, 97, (2, 11)).to(test_device)
    grads = {}
    for impl in ("reference", "chunked", "auto"):
        model.zero_grad()
        with ttt_attention.use_impl(impl):
            outs = model.ttt_forward(aux, ids, 4)
        sum(o[0].square().mean() + o[1].mean() for o in outs).backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for impl in ("chunked", "auto"):
        assert grads[impl].keys() == grads["reference"].keys()
        for n, g in grads[impl].items():
            torch.testing.assert_close(g, grads["reference"][n], rtol=1e-9, atol=1e-11, msg=f"{impl}: {n}")


def test_save_and_load_round_trip(tmp_path):  # CPU-only: serialization, no device math
    model = _drafter(dtype=torch.float32)
    model.d2t.copy_(torch.arange(41) * 1)
    model.save_pretrained(tmp_path)
    again = Eagle3Drafter.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    names = set(again.state_dict())
    assert {
        "fc.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "lm_head.weight",
        "norm.weight",
        "d2t",
        "t2d",
        "embed_tokens.weight",
    } <= names
    assert again.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 2 * 32)  # layer 0 takes 2H


def test_lm_head_starts_from_the_targets_rows_of_the_draft_vocab(test_device):
    from types import SimpleNamespace

    from draftsmith.drafters.vocab import draft_to_target_ids, select_draft_vocab

    tcfg = SimpleNamespace(
        vocab_size=97,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    d2t, t2d = select_draft_vocab(torch.rand(97), 41)  # from token counts: on the CPU, as the trainer makes it
    # the target's embedding and head where the trainer has them: on its device
    embed, head = torch.randn(97, 32).to(test_device), torch.randn(97, 32).to(test_device)
    fresh = Eagle3Drafter.from_target(tcfg, [1, 2, 3], 41, embed, d2t, t2d)
    seeded = Eagle3Drafter.from_target(tcfg, [1, 2, 3], 41, embed, d2t, t2d, head_weight=head)
    assert torch.equal(seeded.lm_head.weight, head[draft_to_target_ids(d2t)].cpu())
    assert seeded.lm_head.weight.requires_grad and not torch.equal(fresh.lm_head.weight, seeded.lm_head.weight)


class _PerfectDrafter(torch.nn.Module):
    """Returns, at step i and slot t, exactly the teacher's distribution at position t+1+i: what a drafter that
    matches the target outputs when the objective aligns tokens, teacher and mask as EAGLE-3 does."""

    def __init__(self, teacher_logprobs, vocab):
        super().__init__()
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long))  # full draft vocabulary
        self.logp = teacher_logprobs

    def forward(self, aux, input_ids, steps, checkpoint=False, heads_from=0):
        T = self.logp.shape[1]
        outs = []
        for i in range(steps):
            shifted = torch.cat([self.logp[:, 1 + i :], self.logp[:, : 1 + i].flip(1)], dim=1)[:, heads_from:T]
            outs.append((shifted, torch.zeros(shifted.shape[:2], device=shifted.device)))
        return outs


def test_the_objectives_offsets_slot_t_at_step_i_predicts_token_t_plus_2_plus_i(test_device):
    """Pinned against an off-by-one: a drafter that outputs the teacher at position t+1+i for slot t of step i is
    right everywhere the mask counts (accuracy 1, soft-label loss = the teacher's entropy), and the mask counts
    slot t of step i exactly when token t+2+i is supervised."""
    from draftsmith.drafters.losses import teacher_from_final
    from draftsmith.drafters.objectives import ObjectiveSettings, eagle3_objective

    V, H, B, T, steps = 11, 8, 2, 12, 3
    g = torch.Generator().manual_seed(0)
    head = (torch.randn(V, H, generator=g, dtype=torch.float64) * 3).to(test_device)  # the objective's device
    final = torch.randn(B, T, H, generator=g, dtype=torch.float64)  # the batch stays on the CPU, as loaded
    loss_mask = torch.zeros(B, T, dtype=torch.uint8)
    loss_mask[0, 4:10] = 1
    loss_mask[1, 2:12] = 1
    batch = {
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "aux": torch.zeros(B, T, 3),
        "final": final,
    }
    teacher = teacher_from_final(final.to(test_device), head, torch.arange(V, device=test_device), 1.0)
    model = _PerfectDrafter(teacher.probs.log(), V).to(test_device)
    s = ObjectiveSettings(steps=steps, temperature=1.0, confidence_weight=0.0)
    _, stats = eagle3_objective(model, batch, head, s)
    _, trimmed = eagle3_objective(model, {**batch, "supervised_from": 2}, head, s)  # the slots from 0 on anyway
    assert {k: float(v) for k, v in trimmed.items()} == {k: float(v) for k, v in stats.items()}
    for i in range(steps):
        expected_n = sum(int(loss_mask[b, t + 2 + i]) for b in range(B) for t in range(T - 2 - i))
        assert stats[f"n_{i}"] == expected_n, i
        assert stats[f"acc_{i}"] == stats[f"n_{i}"], i  # every counted slot predicts its token's teacher argmax
        entropy = sum(
            float(-(teacher.probs[b, t + 1 + i] * teacher.probs[b, t + 1 + i].log()).sum())
            for b in range(B)
            for t in range(T - 2 - i)
            if loss_mask[b, t + 2 + i]
        )
        assert abs(float(stats[f"loss_{i}"]) - entropy) < 1e-6, i


def test_calibration_data_is_what_the_objective_scores_per_chain(test_device):
    """The calibration data of a chain started at slot t is step i's confidence and exact acceptance at that slot:
    at step 0 they sum to the objective's own statistics; a chain reaches step i only while every earlier step had
    a supervised token; and calibrated() applies one temperature per position (the last one past the fitted)."""
    from draftsmith.drafters.objectives import ObjectiveSettings, eagle3_calibration_data, eagle3_objective

    model = _drafter(device=test_device)
    B, T, steps = 2, 14, 3
    g = torch.Generator().manual_seed(1)
    loss_mask = torch.zeros(B, T, dtype=torch.uint8)
    loss_mask[0, 3:9] = 1
    loss_mask[1, 5:14] = 1
    loss_mask[1, 9] = 0  # a hole: chains crossing it stop there
    batch, head = _batch_and_head(loss_mask, g, test_device)
    s = ObjectiveSettings(steps=steps, temperature=1.0)
    with torch.no_grad():
        conf, alpha, valid = eagle3_calibration_data(model, batch, head, s)
        _, stats = eagle3_objective(model, batch, head, s)
    assert conf.shape == alpha.shape == valid.shape == (int(stats["n_0"]), steps) and valid[:, 0].all()
    assert torch.allclose(torch.sigmoid(conf[:, 0]).sum(), stats["conf_0"]) and torch.allclose(
        alpha[:, 0].sum(), stats["accept_0"]
    )
    assert (valid[:, 1:] <= valid[:, :-1]).all() and not valid.all()  # prefix-closed, and the hole cut some chains
    model.config.confidence_temperatures = [0.5, 2.0]
    logit = torch.tensor([1.0], dtype=torch.float64)
    assert [float(model.calibrated(logit, i)) for i in range(3)] == [
        float(torch.sigmoid(logit.float() / t)) for t in (0.5, 2.0, 2.0)
    ]
    # a bias per step after the temperature; and per sampling temperature, the scaling fitted nearest it
    model.config.confidence_biases = [-1.0, 0.5]
    assert [float(model.calibrated(logit, i)) for i in range(3)] == [
        float(torch.sigmoid(logit.float() / t + b)) for t, b in ((0.5, -1.0), (2.0, 0.5), (2.0, 0.5))
    ]
    model.config.sampled_confidence_calibration = {
        "0.0": {"temperatures": [0.5, 2.0], "biases": [-1.0, 0.5]},
        "1.0": {"temperatures": [4.0], "biases": [-2.0]},
    }
    at = lambda sampling: [float(model.calibrated(logit, i, sampling)) for i in range(2)]  # noqa: E731
    greedy = [float(torch.sigmoid(logit.float() / t + b)) for t, b in ((0.5, -1.0), (2.0, 0.5))]
    sampled = [float(torch.sigmoid(logit.float() / 4.0 - 2.0))] * 2
    assert at(0.0) == at(0.3) == at(None) == greedy and at(1.0) == at(0.7) == at(1.5) == sampled


def test_rope_frequencies_move_to_the_device_once_and_stay_fp32(test_device, monkeypatch):
    """The fp32 RoPE frequencies live outside the module's buffers (a bf16 cast must not round them); they follow the
    positions' device on the first forward and are not copied again on later ones (a host-to-device copy per forward
    is a sync on CUDA)."""
    model = _drafter(dtype=torch.bfloat16, device=test_device)
    positions = torch.arange(6, device=test_device)[None]
    like = torch.zeros(1, device=test_device, dtype=torch.bfloat16)
    model._rope(positions, like)
    assert model._inv_freq.device == positions.device and model._inv_freq.dtype == torch.float32
    copies = []
    original = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: copies.append(a) or original(t, *a, **k))
    cos, sin = model._rope(positions, like)
    assert cos.dtype == torch.bfloat16
    assert not [a for a in copies if a and isinstance(a[0], torch.device)], copies  # only the dtype casts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_skipping_the_prompts_vocabulary_projections_changes_nothing(temperature, test_device):
    """With `supervised_from` (the first supervised position of the batch, set by the trainer), the slots that no
    TTT step supervises get no logits (the drafter's lm_head sees T - heads_from rows), and the loss, every statistic
    and every gradient are the same as computing them all. The boundary is tight: one slot fewer changes them."""
    from draftsmith.drafters.objectives import ObjectiveSettings, eagle3_objective, heads_from, supervised_from

    model = _drafter(device=test_device).train()
    B, T, steps = 2, 20, 3
    g = torch.Generator().manual_seed(5)
    loss_mask = torch.zeros(B, T, dtype=torch.uint8)
    loss_mask[0, 9:16] = 1
    loss_mask[1, 11:20] = 1
    batch, head = _batch_and_head(loss_mask, g, test_device)
    s = ObjectiveSettings(steps=steps, temperature=temperature)
    assert supervised_from(loss_mask) == 9 and heads_from({**batch, "supervised_from": 9}, steps) == 5
    assert supervised_from(torch.zeros(B, T)) == T

    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: rows.append(out.shape[1]))

    def run(first):
        model.zero_grad()
        given = {**batch, "supervised_from": first} if first is not None else batch
        loss, stats = eagle3_objective(model, given, head, s)
        loss.backward()
        return loss, stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, trimmed, over = run(None), run(9), run(10)  # 10: one slot past the tight boundary
    hook.remove()
    assert rows == [T] * steps + [T - 5] * steps + [T - 6] * steps
    # the same sums over fewer zero terms: equal up to fp32 summation order (the losses are computed in fp32)
    torch.testing.assert_close(trimmed[0], full[0], rtol=1e-6, atol=0)
    for k in full[1]:
        torch.testing.assert_close(trimmed[1][k], full[1][k], rtol=1e-6, atol=1e-6, msg=k)
    for n in full[2]:
        torch.testing.assert_close(trimmed[2][n], full[2][n], rtol=1e-5, atol=1e-7, msg=n)
    assert float(over[1]["n_2"]) < float(full[1]["n_2"])  # slot 5 at step 2 predicts token 9, the first supervised
