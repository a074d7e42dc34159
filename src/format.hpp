// Number formatting shared by the messages of the core.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ropepool::detail {

// A float the way Python's repr prints it (shortest round trip; "10000.0", "1e-30"), so a
// message reads the same whichever front end made the call.
inline std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  int prec = 0;
  for (prec = 0; prec < 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::snprintf(buf, sizeof buf, "%.*e", prec, x);
  // buf = [-]d[.ddd]e[+-]XX
  std::string s(buf);
  const size_t e = s.find('e');
  const int exp10 = std::atoi(s.c_str() + e + 1);
  const bool neg = s[0] == '-';
  const std::string mant = s.substr(neg ? 1 : 0, e - (neg ? 1 : 0));
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp10 < -4 || exp10 >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out.append(".").append(digits, 1, std::string::npos);
    const int a = std::abs(exp10);
    out += std::string("e") + (exp10 < 0 ? "-" : "+") + (a < 10 ? "0" : "") + std::to_string(a);
  } else if (exp10 < 0) {
    out.append("0.").append(size_t(-exp10 - 1), '0').append(digits);
  } else {
    if (digits.size() <= size_t(exp10) + 1) {
      out.append(digits).append(size_t(exp10) + 1 - digits.size(), '0').append(".0");
    } else {
      out.append(digits, 0, size_t(exp10) + 1).append(".").append(digits, size_t(exp10) + 1, std::string::npos);
    }
  }
  return neg ? std::string("-").append(out) : out;
}

}  // namespace ropepool::detail
