#include "common/rpc.h"

#include "absl/strings/match.h"
#include "common/node_id.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(AdvertisedAddressTest, TheListenHostUnlessAWildcardOrTheAdvertisedOne) {
  EXPECT_EQ(*AdvertisedAddress("127.0.0.1:0", "", 5000), "127.0.0.1:5000");
  EXPECT_EQ(*AdvertisedAddress("10.1.2.3:7000", "", 7000), "10.1.2.3:7000");
  EXPECT_EQ(*AdvertisedAddress("0.0.0.0:0", "server-1.pstrain", 5000), "server-1.pstrain:5000");
  EXPECT_EQ(*AdvertisedAddress("0.0.0.0:7000", "server-1:7001", 7000), "server-1:7001");
  EXPECT_EQ(*AdvertisedAddress("[::]:0", "[fd00::1]", 5000), "[fd00::1]:5000");
  for (const char* wildcard : {"0.0.0.0:0", "[::]:7000", ":7000"}) {
    const absl::StatusOr<std::string> a = AdvertisedAddress(wildcard, "", 7000);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << wildcard;
    EXPECT_TRUE(absl::StrContains(a.status().message(), "--advertise_address")) << a.status();
  }
  for (const char* bad : {"0.0.0.0", "host:port", "host:70000", "a b:1", ":80"}) {
    EXPECT_EQ(AdvertisedAddress("127.0.0.1:0", bad, 1).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(NodeIdTest, AdvertiseAddressesNameTheNode) {
  EXPECT_EQ(*ExpandNodeId("--advertise_address", "{node_id}.pstrain-server:50051",
                          "pstrain-server-1"),
            "pstrain-server-1.pstrain-server:50051");
  EXPECT_EQ(*ExpandNodeId("--advertise_address", "10.0.0.1:50051", ""), "10.0.0.1:50051");
  absl::StatusOr<std::string> missing = ExpandNodeId("--advertise_address", "{node_id}:1", "");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "--advertise_address"));
}

}  // namespace
}  // namespace pstrain
