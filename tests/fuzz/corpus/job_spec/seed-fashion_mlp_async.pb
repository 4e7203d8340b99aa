
fashion-mlp-async€€%!/usr/share/datasets/fashion-mnist"oƒ:(0@8HPX€€`