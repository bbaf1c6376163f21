#pragma once
// Tests build with Catch2 2.x (Debian 12) and 3.x (the GPU image).
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers.hpp>
#define MHLA_CATCH3 1
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif
