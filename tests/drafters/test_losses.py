"""The teacher and the losses built on it: fp32 logits whatever the autocast, and `tv` / `accept` measured
against the target's full-vocabulary distribution (the one acceptance is decided by)."""

import torch

from draftsmith.drafters.losses import acceptance, position_losses, teacher_from_final

V, D, H = 300, 64, 32


def _case(device, seed=0):
    """Drawn on the CPU (the same values on every device), then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(V, H, generator=g) * 2.0  # logits of ~±20: where bf16 rounding moves probabilities
    final = torch.randn(2, 5, H, generator=g)
    draft_ids = torch.randperm(V, generator=g)[:D].sort().values
    logits = torch.randn(2, 5, D, generator=g) * 3
    return tuple(t.to(device) for t in (head, final, draft_ids, logits))


def test_an_argmax_drafts_acceptance_is_the_targets_full_vocabulary_probability_of_it(test_device):
    """A draft taken as the drafter's argmax at T > 0 is kept with the target's probability of that token (softmax
    over the whole vocabulary, not the draft columns); at T = 0 both ways of drafting are the argmax agreement."""
    head, final, draft_ids, logits = _case(test_device)
    for temperature in (0.7, 1.0):
        teacher = teacher_from_final(final, head, draft_ids, temperature)
        p = torch.softmax(final @ head.T / temperature, -1)
        want = p.gather(-1, draft_ids[logits.argmax(-1)][..., None]).squeeze(-1)
        got = acceptance(logits, teacher, draft_ids, temperature, greedy_draft=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert not torch.allclose(got, acceptance(logits, teacher, draft_ids, temperature))  # not Σ min(p, q)
    teacher = teacher_from_final(final, head, draft_ids, 0.0)
    assert torch.equal(
        acceptance(logits, teacher, draft_ids, 0.0, greedy_draft=True), acceptance(logits, teacher, draft_ids, 0.0)
    )


def test_tv_and_accept_are_the_full_vocabulary_acceptance(test_device):
    head, final, draft_ids, logits = _case(test_device)
    for temperature in (0.7, 1.0):
        teacher = teacher_from_final(final, head, draft_ids, temperature)
        alpha = acceptance(logits, teacher, draft_ids, temperature)
        # the renormalized soft labels would overstate acceptance by the mass outside the draft vocab
        assert (teacher.exact.sum(-1) < 0.9).any()
        torch.testing.assert_close(position_losses(logits, teacher, "tv", temperature), 1 - alpha, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            position_losses(logits, teacher, "accept", temperature),
            -torch.log(alpha.clamp_min(1e-9)),
            rtol=0,
            atol=1e-5,
        )
        # and tv is the total variation over the full vocabulary
        p = torch.softmax(final @ head.T / temperature, -1)
        q = torch.zeros_like(p)
        q[..., draft_ids] = torch.softmax(logits / temperature, -1)
        torch.testing.assert_close(
            position_losses(logits, teacher, "tv", temperature), 0.5 * (p - q).abs().sum(-1), rtol=0, atol=1e-5
        )


def test_the_teacher_is_fp32_inside_a_bf16_autocast_region(test_device):
    head, final, draft_ids, _ = _case(test_device, 1)
    reference = teacher_from_final(final.double(), head.double(), draft_ids, 1.0)
    with torch.autocast(test_device.type, dtype=torch.bfloat16):
        teacher = teacher_from_final(final, head, draft_ids, 1.0)
    assert teacher.probs.dtype == torch.float32
    torch.testing.assert_close(teacher.probs, reference.probs.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(teacher.exact, reference.exact.float(), rtol=0, atol=1e-5)
    assert torch.equal(teacher.argmax, reference.argmax)


def test_the_teacher_ahead_is_a_view_and_gives_the_shifted_teachers_values(test_device):
    """EAGLE-3's TTT step i takes the teacher 1+i positions ahead: `ahead` slices the teacher computed once per
    micro-batch (no [B, T, D] copy per step, issue 20) and gives, on every slot that has a teacher, exactly what the
    zero-padded `shifted` copy gave (the slots past the end have loss mask 0)."""
    from draftsmith.drafters.losses import pad_end

    head, final, draft_ids, logits = _case(test_device, 2)
    T = final.shape[1]
    for temperature in (0.0, 0.7):
        teacher = teacher_from_final(final, head, draft_ids, temperature)
        for n in (1, 3):
            ahead, copied = teacher.ahead(n), teacher.shifted(n)
            assert ahead.probs.data_ptr() == teacher.probs[:, n:].data_ptr()  # a view
            live = logits[:, : T - n]
            for kind in ("ce", "tv", "accept"):
                got = pad_end(position_losses(live, ahead, kind, temperature), T)
                want = position_losses(logits, copied, kind, temperature)
                assert torch.equal(got[:, : T - n], want[:, : T - n]), (temperature, n, kind)
                assert got.shape == want.shape and (got[:, T - n :] == 0).all()
            got = pad_end(acceptance(live, ahead, draft_ids, temperature), T)
            assert torch.equal(got[:, : T - n], acceptance(logits, copied, draft_ids, temperature)[:, : T - n])


def test_fused_step_terms_equal_the_reference_values_and_gradients(test_device, monkeypatch):
    """`step_terms` (chunked, fused: what EAGLE-3's objective runs) gives the unfused reference's loss, acceptance,
    argmax agreement and logits gradient, for every loss kind and temperature, with a teacher for the first N < T
    slots (TTT step i's `Teacher.ahead`), in chunks that do not divide N, for fp32 and bf16 logits."""
    from draftsmith.drafters import losses
    from draftsmith.drafters.losses import pad_end, step_terms

    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", {test_device.type: 2 * 2 * D})  # 2 rows of B=2 per chunk
    head, final, draft_ids, logits = _case(test_device, 3)
    T = final.shape[1]
    weights = torch.rand(2, T, generator=torch.Generator().manual_seed(4)).to(test_device)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-6)):
        for temperature in (0.0, 0.7, 1.0):
            teacher = teacher_from_final(final, head, draft_ids, temperature)
            for n in (1, 2):
                ahead = teacher.ahead(n)
                for kind in ("ce", "tv", "accept"):
                    x = logits.to(dtype).clone().requires_grad_(True)
                    loss, alpha, correct = step_terms(x, ahead, draft_ids, kind, temperature)
                    (loss * weights).sum().backward()
                    y = logits.to(dtype).clone().requires_grad_(True)
                    live = y[:, : T - n]
                    want = pad_end(position_losses(live, ahead, kind, temperature), T)
                    (want * weights).sum().backward()
                    where = (dtype, temperature, n, kind)
                    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=tol * 10, msg=str(where))
                    want_alpha = pad_end(acceptance(live.detach(), ahead, draft_ids, temperature), T)
                    torch.testing.assert_close(alpha, want_alpha, rtol=0, atol=tol, msg=str(where))
                    agree = pad_end((draft_ids[live.detach().argmax(-1)] == ahead.argmax).float(), T)
                    assert torch.equal(correct, agree), where
                    assert x.grad.dtype == dtype and (x.grad[:, T - n :] == 0).all(), where
                    gtol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded once
                    torch.testing.assert_close(x.grad.float(), y.grad.float(), rtol=0, atol=gtol, msg=str(where))
                    assert not alpha.requires_grad and not correct.requires_grad
