import torch
from kvpop_hf.topk import running_topk
from kvpop_hf.trainer.sparse_attention import sparse_attention, sparse_attention_block_mask, sparse_attention_reference
dev = torch.device("cuda")
print("tf32", torch.backends.cuda.matmul.allow_tf32, getattr(torch.backends.cuda.matmul, "fp32_precision", None))
for (S, s, w, k) in [(1000, 4, 64, 120), (1024, 4, 64, 120), (777, 0, 16, 300)]:
    g = torch.Generator(device=dev).manual_seed(S)
    mk = lambda *sh: torch.randn(*sh, device=dev, generator=g).requires_grad_(True)
    q, key, value = mk(1, 8, S, 64), mk(1, 2, S, 64), mk(1, 2, S, 64)
    rt = running_topk(torch.randn(1, 2, S, device=dev), s, w, k, backend="torch")
    wv = torch.linspace(-1, 1, 64, device=dev)
    def run(out, lse):
        return (out, lse) + torch.autograd.grad((out.float() * wv).sum() + lse.sum(), (q, key, value))
    ref = run(*sparse_attention_reference(q.double(), key.double(), value.double(), rt, s, w))
    for m in ("interval", "analytic"):
        try:
            got = run(*sparse_attention(q, key, value, rt, s, w, block_mask=sparse_attention_block_mask(rt, s, w, 4, m)))
            print(S, m, ["%.2e" % (a.double() - b).abs().max().item() for a, b in zip(got, ref)],
                  "nan" if any(torch.isnan(a).any().item() for a in got) else "")
        except Exception as e:
            print(S, m, "ERROR", type(e).__name__, str(e)[:300])
