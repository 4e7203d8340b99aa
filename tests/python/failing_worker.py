"""A worker script (started by pstrain-run) that fails the way a user's
first scripts do:

  failing_worker.py no-job       DistributedOptimizer without a job
  failing_worker.py no-table     a pst.EmbeddingBag of a table the job lacks
  failing_worker.py crash        a RuntimeError of the script's own
"""
import sys

import torch

import pstrain.torch as pst


def main():
    what = sys.argv[1]
    model = torch.nn.Linear(4, 2)
    if what == "no-job":
        pst.DistributedOptimizer(model)
    elif what == "no-table":
        model = torch.nn.Sequential(pst.EmbeddingBag("nope"), torch.nn.Linear(4, 2))
        pst.DistributedOptimizer(model, job_yaml="optimizer: {type: sgd, learning_rate: 0.1}\n"
                                 "batch_size: 4\nsteps: 3\n")
    elif what == "crash":
        raise RuntimeError("the script's own error, line %d" % 42)


if __name__ == "__main__":
    main()
