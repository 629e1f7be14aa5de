// The titans CPU kernels as one extension module (titans/ops/cpu_kernels.py builds it on first use).
#include <torch/extension.h>
#include <vector>

torch::Tensor forward(torch::Tensor x, torch::Tensor tail, torch::Tensor wt, c10::optional<torch::Tensor> bias,
                      int64_t P, int64_t H);
std::vector<torch::Tensor> backward(torch::Tensor x, torch::Tensor tail, torch::Tensor wt,
                                    c10::optional<torch::Tensor> bias, torch::Tensor g, int64_t P, int64_t H,
                                    int64_t rows_per_task);
void state_mix_forward(torch::Tensor x, torch::Tensor mix, torch::Tensor out);
void state_mix_backward(torch::Tensor g, torch::Tensor x, torch::Tensor mix, c10::optional<torch::Tensor> g_x,
                        c10::optional<torch::Tensor> g_mix);
std::vector<torch::Tensor> chunk_step_forward(torch::Tensor kq, torch::Tensor v, torch::Tensor gamma,
                                              torch::Tensor beta, torch::Tensor mix, std::vector<torch::Tensor> states,
                                              std::vector<torch::Tensor> outs, std::vector<torch::Tensor> anchors,
                                              int64_t activation, bool residual, double clip, double threshold);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_conv_silu_forward", &forward, "causal depthwise conv + SiLU, forward");
  m.def("causal_conv_silu_backward", &backward, "causal depthwise conv + SiLU, backward");
  m.def("state_mix_forward", &state_mix_forward, "X' = mix @ X + U in place (out holds U)");
  m.def("state_mix_backward", &state_mix_backward, "the chunk step's state mixing, backward");
  m.def("chunk_step_forward", &chunk_step_forward, "the memory's chunk step without autograd (depth 1-2, l2)");
}
