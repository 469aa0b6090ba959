// Deliberately broken stage file: line 6 uses an undeclared name.
kernel void broken(device float* out [[buffer(0)]],
                   uint i [[thread_position_in_grid]]) {
  float ok = twice(1.0f);
  out[i] = ok;
  out[i] += undeclared_thing;
}
