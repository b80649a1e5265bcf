"""The program of issue 12, verbatim: streams and a Task left open at exit."""
import torch
from xlaunch import CPUPool, MultiStreamModule, Task
model = torch.nn.Linear(4, 2).eval()
m = MultiStreamModule(model, 2, CPUPool([0, 1])); print(m(torch.randn(4, 4)).shape)
t = Task(model, CPUPool([1])); print(t(torch.randn(4, 4)).result().shape)
