"""A worker script written like the docs' ShardedLoader snippet but
without `if __name__ == "__main__":` (started by pstrain-run)."""
import torch

import pstrain.torch as pst

model = torch.nn.Linear(4, 2)
opt = pst.DistributedOptimizer(model, job_yaml="optimizer: {type: sgd, learning_rate: 0.1}\n"
                               "batch_size: 4\nsteps: 20\n")
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
for x, y in pst.ShardedLoader(data, opt.client, num_workers=2):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step(loss)
opt.finish()
