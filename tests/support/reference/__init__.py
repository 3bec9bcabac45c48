"""The plain-autograd oracles the ``fitdqn::`` operators are tested against (their CPU kernels, their Triton kernels
under the interpreter, CUDA): the maths written the obvious way, every tensor autograd wants kept."""
