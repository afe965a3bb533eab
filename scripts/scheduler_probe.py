"""How long the serving scheduler's plan takes a decode step on this CPU (no model, no GPU): a
closed loop of CONCURRENCY chat-like requests (prompts of 64-1,024 tokens, 64-512 out) over a
pool of 16-token blocks, the scheduler mixing prefill chunks into steps as on a GPU, with the
token bookkeeping the engine does (a token a decoding row, finished rows released and replaced).
Usage: python scripts/scheduler_probe.py [CONCURRENCY ...]   (default 64 128 256)
"""

import random
import sys
import time

from llamactl.runtime.settings import Sampling
from llamactl.serve.blocks import BlockPool
from llamactl.serve.plan import Params
from llamactl.serve.scheduler import Scheduler

def run(conc: int, steps: int = 300, blocks: int = 24000) -> None:
    rng = random.Random(0)
    s = Scheduler(256, 1024, 4096, 8192, True, 0.0, mix=True)
    s.use_pool(BlockPool(blocks, 16))
    live = []
    def new() -> None:
        n = rng.randint(64, 1024)
        first = rng.randint(0, 10**9)
        r = s.submit([first + i for i in range(n)], Params(rng.randint(64, 512), Sampling(temperature=0), ignore_eos=True),
                     lambda ev: None)
        live.append(r)
    for _ in range(conc):
        new()
    plan_t = emit_t = 0.0
    n_steps = rows = 0
    for i in range(steps + 50):
        t0 = time.perf_counter()
        plan = s.schedule(busy=True)
        step = plan.decode if s.mixing else s.decode()
        t1 = time.perf_counter()
        # the engine's bookkeeping: each decoding row gets a token; finished rows are released
        done = []
        if step is not None:
            for r in step.requests:
                r.tokens.append(1)
                if r.generated >= r.params.max_tokens:
                    done.append(r)
        for w in plan.prefills:
            for r, end in zip(w.requests, w.ends):
                if end:
                    r.tokens.append(1)
        for r in done:
            s.release(r)
            r.finished = True
            live.remove(r)
            new()
        t2 = time.perf_counter()
        if i >= 50 and step is not None:
            plan_t += t1 - t0; emit_t += t2 - t1; n_steps += 1; rows += len(step.requests)
    print(f"concurrency {conc}: {rows / max(n_steps, 1):.0f} rows a step, the plan {plan_t / n_steps * 1e3:.2f} ms "
          f"a step, the bookkeeping {emit_t / n_steps * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    for c in [int(x) for x in sys.argv[1:]] or [64, 128, 256]:
        run(c)
