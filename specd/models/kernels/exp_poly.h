// exp(x) for x <= 0, as x = n ln2 + r with |r| <= ln2 / 2: exp(r) by its Taylor polynomial
// to r^6 (relative error < 2e-7), times 2^n. The constants, shared by paged attention's
// vectors (its softmax) and layer_ops' scalar code (SiLU, vectorised by the compiler).
#pragma once

namespace exp_poly {
constexpr float MIN_X = -87.0f;  // below, exp would leave the normal range
constexpr float LOG2E = 1.44269504f;
constexpr float LN2_HI = 0.693145752f;  // ln2 in two parts: n * LN2_HI is exact
constexpr float LN2_LO = 1.42860677e-6f;
constexpr int DEGREE = 6;
constexpr float C[DEGREE + 1] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // r^6 .. 1
}  // namespace exp_poly
