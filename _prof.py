import cProfile, pstats, time
import numpy as np, cutp
from cutp.tensor_parallel.moe import MoEMLP
ctx = cutp.init(device="cpu")
N,h,E,F,k = 1024,1024,256,256,8
moe = MoEMLP(ctx, h, n_experts=E, top_k=k, ffn=F, aux_loss_coeff=0.0, renormalize=True, name="moe", bias=False, dtype=np.float32, kind="swiglu")
x = np.random.default_rng(0).standard_normal((1,N,h)).astype(np.float32)
moe.train()
def step():
    moe.forward(x); moe.backward(x*1e-3)
step()
pr = cProfile.Profile(); pr.enable(); t=time.time(); step(); print("t", time.time()-t); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
